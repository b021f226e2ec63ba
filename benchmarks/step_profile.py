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

For ``adaptive_tree`` methods, rows marked ``[drafting]``, ``[probe]``,
``[paused]`` and ``[no proposal]`` split the steps by what the step's
proposal did (the plugin's counters read after every step, outside its
timing): what a paused drafter costs per step, and what a probe costs.

Reproduce (about 12 minutes on 2 CPU cores; writes ``step_profile.{json,md}``)::

    .venv/bin/python benchmarks/step_profile.py
    .venv/bin/python benchmarks/step_profile.py --methods none,tree-16 --batch-sizes 8
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engines  # noqa: E402
from engines import REPO  # noqa: E402

MAX_LEN = 64  # l_max = l_min = 64: the suffix never matches, no tree is drafted


def method_config(name: str) -> dict | None:
    """The speculative config of a method name; ``NAME@POLICY`` picks a
    model drafter's policy (default ``eagle2``; e.g. ``eagle3-adaptive-32@talon``)."""
    name, _, policy = name.partition("@")
    if name == "none":
        return None
    if name == "ngram":
        return dict(engines.NGRAM)
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
    from vllm import SamplingParams

    from vllm_adaptive_spec.adapter import step_profile

    llm = engines.open_engine(job, max(job["batch_sizes"]))
    engine = llm.llm_engine
    tokenizer = llm.get_tokenizer()
    prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False) for m in job["conversations"]]
    params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"])
    llm.collective_rpc(step_profile.install)

    tree_method = engines.is_tree_method(job)

    def kind_of_step(before: dict, after: dict) -> str:
        """What the step's proposal did: drafted, a probe, paused, or none asked."""
        for kind in ("probes", "paused"):
            if after[kind] > before[kind]:
                return kind.removesuffix("s")
        return "drafting" if after["drafting_steps"] > before["drafting_steps"] else "no proposal"

    def run(count: int, in_flight: int) -> dict:
        llm.reset_prefix_cache()
        llm.collective_rpc(step_profile.reset)
        before = counters = engines.tree_counters(llm, tree_method)
        phases: dict = {}
        by_kind: dict[str, dict] = {}
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
            if tree_method:  # each step's phases, by what its proposal did (read outside the timed step)
                now, now_phases = engines.tree_counters(llm, True), llm.collective_rpc(step_profile.report)[0]
                kind = by_kind.setdefault(kind_of_step(counters, now), {"steps": 0, "wall_s": 0.0, "phases": {}})
                kind["steps"] += 1
                kind["wall_s"] += step_seconds[-1]
                for key, (seconds, calls) in now_phases.items():
                    old = phases.get(key, (0.0, 0))
                    total = kind["phases"].setdefault(key, [0.0, 0])
                    total[0] += seconds - old[0]
                    total[1] += calls - old[1]
                counters, phases = now, now_phases
        after = engines.tree_counters(llm, tree_method)
        return {"steps": len(step_seconds), "wall_s": sum(step_seconds), "tokens": tokens,
                "phases": llm.collective_rpc(step_profile.report)[0],
                "tree": {k: after[k] - before[k] for k in after}, "by_kind": by_kind}

    run(2, 2)  # warm-up
    results = []
    for batch_size in job["batch_sizes"]:
        result = run(max(batch_size, job["min_prompts"]), batch_size)
        result["batch_size"] = batch_size
        results.append(result)
        print(f"[worker] b={batch_size}: {result['steps']} steps, {result['tokens']} tokens", flush=True)
    Path(job["result_path"]).write_text(json.dumps({"runs": results}), encoding="utf-8")


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
        for kind, part in (row.get("by_kind") or {}).items():
            cols = self_times(part["phases"])
            cells = [f"{row['method']} [{kind}]", str(row["batch_size"]), "", f"{part['steps']} steps",
                     f"{1000 * part['wall_s'] / part['steps']:.1f}"]
            cells += [f"{1000 * cols[c] / part['steps']:.2f}" for c in COLUMNS]
            cells += [f"{1000 * (part['wall_s'] - sum(cols.values())) / part['steps']:.2f}", "", ""]
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
    parser.add_argument("--head", default=str(engines.HEAD), help="EAGLE-3 head (eagle3-N)")
    parser.add_argument("--prompts", help="prompt set JSONL (default: the project's)")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds per engine process")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    model = str(ensure_demo_model())
    batch_sizes = [int(b) for b in args.batch_sizes.split(",")]
    conversations = [p.messages for p in engines.interleave_categories(load_prompts(args.prompts))]
    conversations = conversations[: max(max(batch_sizes), args.min_prompts)]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for method in args.methods.split(","):
        spec = method_config(method)
        if spec is not None and spec.get("tree", {}).get("drafter") in ("eagle3", "hybrid"):
            spec["model"] = args.head
        elif spec is not None and spec.get("tree", {}).get("drafter") == "draft_model":
            spec["model"] = engines.draft_lm_path()
        job = {"model": model, "dtype": args.dtype, "speculative_config": spec,
               "batch_sizes": batch_sizes, "max_tokens": args.max_tokens, "min_prompts": args.min_prompts,
               "max_model_len": engines.needed_model_len(model, conversations, args.max_tokens),
               "conversations": conversations, "engine_layout": args.engine_layout}
        print(f"{method} ...", flush=True)
        result = engines.run_engine(job, out, f"profile-{method}", args.worker_timeout, script=Path(__file__).resolve())
        if "error" in result:
            rows += [{"method": method, "batch_size": b, "error": f"{result['error']}, see {result['log']}"}
                     for b in batch_sizes]
            continue
        rows += [{"method": method, **r} for r in result["runs"]]
    report = {"settings": engines.portable_paths(vars(args)), "rows": rows}
    (out / "step_profile.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = table(report)
    (out / "step_profile.md").write_text(text + "\n", encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
