"""Where an engine step's time goes, per method and batch size (CPU or GPU).

For every method and batch size b: b requests in flight (``max(b, 4)`` prompts
in all, round-robin over the prompt categories, greedy, ``--max-tokens``
each), the engine stepped by hand. Each step's wall time is measured around
``LLMEngine.step``; inside the worker the phases are timed by
``vllm_adaptive_spec.adapter.step_profile``. The table gives milliseconds per
engine step (self time: a phase's time without the phases inside it):

* ``forward``: the target model without attention; ``attn``: vLLM's C++
  attention in the target forward; ``tree_attn``: tree rows (torch/Triton);
* ``prepare``: input layout (vLLM's and the tree layout);
* ``verify``: sampling and tree verification; ``compact``: KV compaction
  (and the load budget's observations);
* ``draft``: the drafter: ``grow`` (the tree proposer: index updates, policy,
  tree assembly), ``dpass`` (model drafters' passes, their attention
  included), ``dbook`` (a model drafter's bookkeeping around its pass over
  the committed tokens: gathers, the paused rows it keeps), ``draft_self``
  (the rest of vLLM's / the plugin's drafting);
* ``runner``: the rest of the worker's ``execute_model`` / ``sample_tokens``;
  ``engine``: the step's wall time outside the worker (scheduler, IPC,
  detokenisation);
* ``leaf``: the share of verified trees whose accepted path reached a leaf,
  and ``overlap <=``: that share of the drafting time (``grow``, ``dpass``,
  ``dbook``, ``draft_self``) over the step time. Talon's overlapped rounds draft step
  ``t + 1`` during step ``t``'s forward on a guessed outcome of ``t`` (a whole
  path accepted, and the bonus token); the guess is right at most on the
  ``leaf`` share, so an overlap saves at most ``overlap <=`` of the step time
  (less for EAGLE-3, which needs step ``t``'s hidden states to draft at all).

Methods: ``none``, ``ngram`` (vLLM's, K=4), ``tree-N`` (adaptive_tree
retrieval, ``load_budget: fixed`` at N), ``tree-adaptive-N`` (the default load
budget, at most N) and ``tree-0`` (adaptive_tree whose suffix can never match:
the plugin's cost with no tree at all); ``eagle3-N`` / ``draft-lm-N``: the
model drafters (EAGLE-2 trees of N nodes, ``load_budget: fixed``; the head of
``--head``, the draft LM of ``vllm-adaptive-spec draft-lm``), whose ``dpass``
share bounds what overlapping drafting with verification could save;
``eagle3-adaptive-N`` / ``draft-lm-adaptive-N``: the same under the default
load budget (what a model drafter costs while the budget pauses it);
``hybrid-N`` / ``hybrid-adaptive-N``: the EAGLE-3 head's EAGLE-2 tree merged
with the retrieval trie (Talon's hybrid), likewise. ``@POLICY`` after a model
drafter's name picks its policy (``eagle3-adaptive-32@talon``).

Reproduce (about 12 minutes on 2 CPU cores; writes ``step_profile.{json,md}``)::

    .venv/bin/python benchmarks/step_profile.py
    .venv/bin/python benchmarks/step_profile.py --methods none,tree-16 --batch-sizes 8
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

MAX_LEN = 64  # l_max = l_min = 64: the suffix never matches, no tree is drafted


def method_config(name: str) -> dict | None:
    """The speculative config of a method name; ``NAME@POLICY`` picks a
    model drafter's policy (default ``eagle2``; e.g. ``eagle3-adaptive-32@talon``)."""
    name, _, policy = name.partition("@")
    if name == "none":
        return None
    if name == "ngram":
        return {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
    if name.startswith("tree-"):
        adaptive = name.startswith("tree-adaptive-")
        budget = int(name.rsplit("-", 1)[1])
        tree = {"drafter": "retrieval", "policy": "retrieval", "load_budget": "adaptive" if adaptive else "fixed"}
        if budget == 0:
            tree.update(l_max=MAX_LEN, l_min=MAX_LEN)
        return {"method": "adaptive_tree", "num_speculative_tokens": max(budget, 1), "tree": tree}
    for prefix, drafter in (("eagle3-", "eagle3"), ("draft-lm-", "draft_model"), ("hybrid-", "hybrid")):
        if name.startswith(prefix):
            adaptive = name.startswith(prefix + "adaptive-")
            return {"method": "adaptive_tree", "num_speculative_tokens": int(name.rsplit("-", 1)[1]),
                    "tree": {"drafter": drafter, "policy": policy or "eagle2",
                             "load_budget": "adaptive" if adaptive else "fixed"}}
    raise ValueError(f"unknown method {name!r}: none, ngram, tree-N, tree-adaptive-N, eagle3-N, eagle3-adaptive-N, "
                     "draft-lm-N, draft-lm-adaptive-N, hybrid-N, hybrid-adaptive-N")


COLUMNS = {
    "forward": ["execute_model/forward"],
    "attn": ["execute_model/forward/attention"],
    "tree_attn": ["execute_model/forward/tree_attention", "execute_model/forward/attention/tree_attention"],
    "prepare": ["execute_model/prepare"],
    "verify": ["sample_tokens/verify"],
    "compact": ["sample_tokens/verify/compaction"],
    "grow": ["sample_tokens/draft/grow"],
    "dpass": ["sample_tokens/draft/draft_first_pass/draft_forward", "sample_tokens/draft/grow/draft_pass"],
    "dbook": ["sample_tokens/draft/draft_first_pass"],
    "draft_self": ["sample_tokens/draft"],
    "runner": ["execute_model", "sample_tokens"],
}


def self_times(phases: dict) -> dict[str, float]:
    """Seconds per column, each phase without the phases nested in it."""
    inclusive = {key: value[0] for key, value in phases.items()}
    own = {}
    for key, seconds in inclusive.items():
        children = [k for k in inclusive if k.startswith(key + "/") and "/" not in k[len(key) + 1:]]
        own[key] = seconds - sum(inclusive[k] for k in children)
    columns = {}
    for column, keys in COLUMNS.items():
        if column == "dpass":
            # Model drafters' passes with everything inside them.
            columns[column] = sum(inclusive.get(k, 0.0) for k in keys)
        else:
            columns[column] = sum(own.get(k, 0.0) for k in keys)
    return columns


def worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    # The timers are installed by sending a function to the worker process
    # (collective_rpc), which vLLM only pickles with this set.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    in_process = job.get("engine_layout") == "in-process"
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM, SamplingParams

    from vllm_adaptive_spec.adapter import step_profile
    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    llm = LLM(**engine_kwargs(job["model"], job["dtype"], job["max_model_len"], max(job["batch_sizes"]),
                              job["speculative_config"]),
              **({"distributed_executor_backend": "uni"} if in_process else {}))
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in job["conversations"]]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    llm.collective_rpc(step_profile.install)

    tree_method = (job["speculative_config"] or {}).get("method") == "adaptive_tree"

    def tree_stats() -> dict:
        return llm.collective_rpc("adaptive_tree_stats")[0] if tree_method else {}

    def run(count: int, in_flight: int) -> dict:
        llm.reset_prefix_cache()
        llm.collective_rpc(step_profile.reset)
        before = tree_stats()
        waiting = list(range(count))
        step_seconds, tokens, running = [], 0, 0
        while waiting or engine.has_unfinished_requests():
            while waiting and running < in_flight:
                index = waiting.pop(0)
                engine.add_request(f"p{index}-{time.monotonic_ns()}", prompts[index % len(prompts)], params)
                running += 1
            started = time.perf_counter()
            outputs = engine.step()
            step_seconds.append(time.perf_counter() - started)
            for output in outputs:
                if output.finished:
                    running -= 1
                    tokens += len(output.outputs[0].token_ids)
        after = tree_stats()
        return {"steps": len(step_seconds), "wall_s": sum(step_seconds), "tokens": tokens,
                "phases": llm.collective_rpc(step_profile.report)[0],
                "tree": {k: after[k] - before[k] for k in ("trees_verified", "leaf_paths") if k in after}}

    run(2, 2)  # warm-up
    results = []
    for batch_size in job["batch_sizes"]:
        result = run(max(batch_size, job["min_prompts"]), batch_size)
        result["batch_size"] = batch_size
        results.append(result)
        print(f"[worker] b={batch_size}: {result['steps']} steps, {result['tokens']} tokens", flush=True)
    Path(job["result_path"]).write_text(json.dumps(results), encoding="utf-8")


def table(report: dict) -> str:
    head = ["method", "b", "tok/s", "tok/step", "ms/step", *COLUMNS, "engine", "leaf", "overlap <="]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['method']} | {row['batch_size']} | {row['error']} |")
            continue
        steps = row["steps"]
        cols = self_times(row["phases"])
        worker_s = sum(cols.values())
        cells = [row["method"], str(row["batch_size"]), f"{row['tokens'] / row['wall_s']:.1f}",
                 f"{row['tokens'] / steps:.2f}", f"{1000 * row['wall_s'] / steps:.1f}"]
        cells += [f"{1000 * cols[c] / steps:.2f}" for c in COLUMNS]
        cells.append(f"{1000 * (row['wall_s'] - worker_s) / steps:.2f}")
        tree = row.get("tree") or {}
        if tree.get("trees_verified"):
            leaf = tree["leaf_paths"] / tree["trees_verified"]
            drafting = sum(cols[c] for c in ("grow", "dpass", "dbook", "draft_self"))
            cells += [f"{leaf:.0%}", f"{leaf * drafting / row['wall_s']:.1%}"]
        else:
            cells += ["", ""]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none,ngram,tree-0,tree-1,tree-4,tree-16,tree-60,tree-adaptive-16")
    parser.add_argument("--batch-sizes", default="1,8,64")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--min-prompts", type=int, default=4, help="prompts per pass at least (b=1 runs them in turn)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default): on CPUs without native bf16 (AVX2 only), bf16 matmuls cost "
                             "the same per row whatever the batch, so no speculation can pay there")
    parser.add_argument("--engine-layout", choices=("processes", "in-process"), default="processes",
                        help="as in benchmarks/throughput.py: vLLM's processes, or engine and worker in one process")
    parser.add_argument("--head", default=str(REPO / "heads" / "smollm2-135m-eagle3"), help="EAGLE-3 head (eagle3-N)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return

    sys.path.insert(0, str(REPO / "benchmarks"))
    from throughput import _needed_model_len, interleave_categories, portable_paths

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    model = str(ensure_demo_model())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    conversations = [p.messages for p in interleave_categories(load_prompts())]
    conversations = conversations[: max(max(batch_sizes), args.min_prompts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods.split(","):
        spec = method_config(method)
        if spec is not None and spec.get("tree", {}).get("drafter") in ("eagle3", "hybrid"):
            spec["model"] = args.head
        elif spec is not None and spec.get("tree", {}).get("drafter") == "draft_model":
            from vllm_adaptive_spec.training.draft_lm import ensure_draft_lm

            spec["model"] = str(ensure_draft_lm(layers=4, minutes=6.0))
        job = {"model": model, "dtype": args.dtype, "speculative_config": spec,
               "batch_sizes": batch_sizes, "max_tokens": args.max_tokens, "min_prompts": args.min_prompts,
               "max_model_len": _needed_model_len(model, conversations, args.max_tokens),
               "conversations": conversations, "result_path": str(out / f"profile-{method}.result.json"),
               "engine_layout": args.engine_layout}
        job_path = out / f"profile-{method}.job.json"
        job_path.write_text(json.dumps(job), encoding="utf-8")
        print(f"{method} ...", flush=True)
        log = out / f"profile-{method}.log"
        with log.open("w") as handle:
            # Its own session, so an interrupted run also ends the engine processes it spawned.
            proc = subprocess.Popen([sys.executable, __file__, "--worker", str(job_path)], stdout=handle,
                                    stderr=subprocess.STDOUT, cwd=REPO, start_new_session=True)
            try:
                code = proc.wait()
            finally:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
        if code != 0:
            rows += [{"method": method, "batch_size": b, "error": f"worker exited {code}, see {log}"} for b in batch_sizes]
            continue
        rows += [{"method": method, **r} for r in json.loads(Path(job["result_path"]).read_text())]
    report = {"settings": portable_paths(vars(args)), "rows": rows}
    (out / "step_profile.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = table(report)
    (out / "step_profile.md").write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
