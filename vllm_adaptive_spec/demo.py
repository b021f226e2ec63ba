"""The demo: offline ``LLM.chat`` on the demo model over a handful of the
project's prompts (one per category), with adaptive-tree speculation and
without, printing the answers, tau and the speed ratio.

Decision: both engines run in this process (vLLM's in-process engine core
and single-process executor), one after the other. With vLLM's engine-core
process, its shutdown sends that process SIGTERM, which Python hands to the
process's main thread only when the signal lands there: when another thread
takes it, the main thread sleeps on, the core is killed after 5 s and its
executor's shared memory and locks are left to the resource tracker, whose
"leaked semaphore / shared_memory" warnings then end the demo (measured:
three of four runs). In one process nothing is left behind, and two engine
processes fewer start.
"""

from __future__ import annotations

import argparse
import gc
import os
import time

DEFAULT_SPEC = {
    "method": "adaptive_tree",
    "num_speculative_tokens": 16,
    "tree": {"drafter": "retrieval", "policy": "retrieval", "load_budget": "adaptive"},
}


def spec_counters(llm) -> dict[str, float]:
    return {m.name: getattr(m, "value", 0) for m in llm.get_metrics() if m.name.startswith("vllm:spec_decode_num")}


def run(model: str, dtype: str, messages: list, max_tokens: int, spec: dict | None):
    """Generate greedily; return (outputs, seconds, tau or None, the plugin's
    stats since the engine started, warm-up included, or None)."""
    from vllm import LLM, SamplingParams

    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    llm = LLM(**engine_kwargs(model, dtype, max_model_len=2048, max_num_seqs=len(messages), speculative_config=spec),
              distributed_executor_backend="uni")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    llm.chat(messages[:1], SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    before = spec_counters(llm)
    start = time.perf_counter()
    outputs = llm.chat(messages, params, use_tqdm=False)
    elapsed = time.perf_counter() - start
    tau = stats = None
    if spec is not None:
        after = spec_counters(llm)
        drafts = after["vllm:spec_decode_num_drafts"] - before["vllm:spec_decode_num_drafts"]
        accepted = after["vllm:spec_decode_num_accepted_tokens"] - before["vllm:spec_decode_num_accepted_tokens"]
        tau = 1 + accepted / max(drafts, 1)
        stats = llm.collective_rpc("adaptive_tree_stats")[0]
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    return outputs, elapsed, tau, stats


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: the demo model, converted if needed)")
    parser.add_argument("--prompts", help="prompt set JSONL (default: vllm_adaptive_spec/data/prompts.jsonl)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument(
        "--dtype", default="float32", help="float32 (default) makes greedy answers comparable token for token"
    )
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engines in this process (see the module's docstring)

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts, one_per_category

    model = args.model or str(ensure_demo_model())
    prompts = one_per_category(load_prompts(args.prompts))
    messages = [p.messages for p in prompts]

    plain, plain_seconds, _, _ = run(model, args.dtype, messages, args.max_tokens, None)
    tree, tree_seconds, tau, stats = run(model, args.dtype, messages, args.max_tokens, DEFAULT_SPEC)

    generated = sum(len(o.outputs[0].token_ids) for o in tree)
    for prompt, output in zip(prompts, tree):
        print(f"\n=== {prompt.id} ({prompt.category}) ===")
        print(f"Q: {prompt.messages[-1]['content'][:200]}")
        print(f"A: {output.outputs[0].text.strip()}")
    same = sum(a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(plain, tree))
    plain_rate = sum(len(o.outputs[0].token_ids) for o in plain) / plain_seconds
    tree_rate = generated / tree_seconds
    print(f"\n{len(prompts)} prompts, {generated} tokens, speculative config: {DEFAULT_SPEC}")
    print(f"no speculation: {plain_rate:.1f} tok/s")
    print(f"adaptive_tree:  {tree_rate:.1f} tok/s, tau {tau:.2f} tokens per step")
    print(
        f"the load budget verified {stats['nodes_per_tree']:.1f} nodes per tree (of N = "
        f"{DEFAULT_SPEC['num_speculative_tokens']}) and drafted in {100 * stats['drafting_share']:.0f}% of steps"
    )
    print(f"speed ratio (adaptive_tree / none): {tree_rate / plain_rate:.2f}; identical answers: {same}/{len(prompts)}")


if __name__ == "__main__":
    main()
