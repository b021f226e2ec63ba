"""The host time of a drafting step, outside torch operations, per batch size
(a drafter's host work must not grow with the batch, or a GPU waits on it).

For each drafter and batch size ``b``: ``b`` prompts of the project's set (or ``--prompts``) in
flight (greedy, ``--max-tokens``), the engine in this process; after
``--warmup`` steps, each of ``--steps`` engine steps' drafting
(``propose_draft_token_ids``: the first pass, growth, the load budget, the
trees handed to vLLM) runs under ``torch.profiler``. A step's host time is
its wall time less the time inside top-level torch operations, and less the
draft model's forwards (``PagedDraftBackend.run``, labelled
``draft_forward``: vLLM's model code, which the draft loop's graphs replace
on a GPU). The table gives the median per step in milliseconds, the torch
operations dispatched per step, and the ratio of batch ``b`` to the first.
The profiler adds its own cost per operation, so absolute values are upper
bounds; what counts is the ratio between batch sizes (the aim: batch 64
within 10% of batch 8).

Drafters: ``retrieval`` (the trie), ``retrieval-tensors`` (``matcher:
tensors``), ``eagle3`` (the project's head, EAGLE-2 tree at depth 8, ``N =
--nodes``, ``load_budget: fixed``, ``step_shape: ragged``), ``eagle3-fixed``
(the same in uniform steps, ``step_shape: uniform``: every layer ``B x F``
rows, nothing read back), ``hybrid`` (the head's EAGLE-2 tree merged with the
trie matcher's, ragged) and ``hybrid-fixed`` (merged with the tensor matcher's
children, ``step_shape: uniform``).

Reproduce (about 4 minutes on 2 CPU cores)::

    .venv/bin/vllm-adaptive-spec bench draft-host-time
    .venv/bin/vllm-adaptive-spec bench draft-host-time --drafters eagle3 --batch-sizes 8,64
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from pathlib import Path

from benchmarks.engines import HEAD, run_apart
from benchmarks.options import add_batches, add_output, add_workload
from benchmarks.report import write_report


MODEL_DRAFTERS = {  # name -> the tree config's drafter, its step_shape and the hybrid's matcher
    "eagle3": ("eagle3", "ragged", {}),
    "eagle3-fixed": ("eagle3", "uniform", {}),
    "hybrid": ("hybrid", "ragged", {"matcher": "trie"}),
    "hybrid-fixed": ("hybrid", "uniform", {"matcher": "tensors"}),
}


def spec_of(drafter: str, nodes: int, head: str) -> dict:
    if drafter in MODEL_DRAFTERS:
        kind, shape, matcher = MODEL_DRAFTERS[drafter]
        tree = {"drafter": kind, "policy": "eagle2", "depth": 8, "load_budget": "fixed", "step_shape": shape, **matcher}
        return {"method": "adaptive_tree", "num_speculative_tokens": nodes, "model": head, "tree": tree}
    matcher = {"retrieval": "trie", "retrieval-tensors": "tensors"}[drafter]
    tree = {"drafter": "retrieval", "matcher": matcher, "load_budget": "fixed"}
    return {"method": "adaptive_tree", "num_speculative_tokens": nodes, "tree": tree}


def profile_drafting(worker, warmup: int, steps: int) -> None:
    """Run each drafting step after ``warmup`` under the profiler (in the
    worker, through ``collective_rpc``); the samples land on the worker."""
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    runner = worker.model_runner
    propose, seen = runner.propose_draft_token_ids, [0]
    worker.draft_host_samples = samples = []
    backend = runner._draft_backend
    if backend is not None:
        run = backend.run

        def labelled(*args, **kwargs):
            with record_function("draft_forward"):
                return run(*args, **kwargs)

        backend.run = labelled

    def profiled(*args, **kwargs):
        seen[0] += 1
        if not warmup < seen[0] <= warmup + steps:
            return propose(*args, **kwargs)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            started = time.perf_counter()
            out = propose(*args, **kwargs)
            wall = time.perf_counter() - started
        events = prof.events()
        top = [e for e in events if e.cpu_parent is None]
        inside = sum(e.time_range.elapsed_us() for e in top) / 1e3
        forward = sum(e.time_range.elapsed_us() for e in top if e.name == "draft_forward") / 1e3
        ops = sum(1 for e in events if e.name.startswith("aten::") and (e.cpu_parent is None
                                                                         or e.cpu_parent.name == "draft_forward"))
        samples.append({"wall_ms": wall * 1e3, "host_ms": wall * 1e3 - inside, "forward_ms": forward,
                        "torch_ms": inside - forward, "top_ops": ops, "threads": torch.get_num_threads()})
        return out

    runner.propose_draft_token_ids = profiled


def measure(model: str, spec: dict, batch: int, args) -> dict:
    from vllm import LLM, SamplingParams

    from vllm_adaptive_spec.prompts import load_prompts

    prompts = [p.messages for p in load_prompts(args.prompts)]
    conversations = [prompts[i % len(prompts)] for i in range(batch)]
    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    llm = LLM(**engine_kwargs(model, args.dtype, max_model_len=2048, max_num_seqs=batch, speculative_config=spec))
    try:
        llm.collective_rpc(profile_drafting, args=(args.warmup, args.steps))
        llm.chat(conversations, SamplingParams(max_tokens=args.max_tokens, temperature=0), use_tqdm=False)
        samples = llm.collective_rpc(lambda worker: worker.draft_host_samples)[0]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    if not samples:
        return {"error": "no drafting step was profiled (raise --max-tokens)"}
    return {key: statistics.median(s[key] for s in samples) for key in samples[0]} | {"steps": len(samples)}


def table(rows: list[dict]) -> str:
    lines = ["| drafter | b | steps | host ms | vs first b | torch ms | forward ms | wall ms | top-level ops |",
             "|---|---|---|---|---|---|---|---|---|"]
    first: dict[str, float] = {}
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['drafter']} | {row['batch']} | {row['error']} |")
            continue
        base = first.setdefault(row["drafter"], row["host_ms"])
        lines.append(f"| {row['drafter']} | {row['batch']} | {row['steps']} | {row['host_ms']:.2f} | "
                     f"{row['host_ms'] / base:.2f}x | {row['torch_ms']:.2f} | {row['forward_ms']:.2f} | "
                     f"{row['wall_ms']:.2f} | {row['top_ops']:.0f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="retrieval,retrieval-tensors,eagle3")
    add_batches(parser, "8,64")
    add_workload(parser, max_tokens=48, prompts=None)
    parser.add_argument("--nodes", "--budget", type=int, default=16, help="N, nodes per tree")
    parser.add_argument("--warmup", type=int, default=8, help="engine steps before profiling")
    parser.add_argument("--steps", type=int, default=12, help="profiled drafting steps")
    parser.add_argument("--head", default=str(HEAD))
    parser.add_argument("--dtype", default="float32")
    add_output(parser)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # DRAFTER:BATCH, measured in this process
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, where the hooks are
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # collective_rpc with functions
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.one:
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        drafter, batch = args.one.split(":")
        row = measure(str(ensure_demo_model()), spec_of(drafter, args.nodes, args.head), int(batch), args)
        (out / f"draft_host_time.{drafter}.{batch}.json").write_text(json.dumps(row) + "\n")
        return
    rows = []
    for drafter in args.drafters.split(","):
        for batch in args.batch_sizes:
            print(f"{drafter} b={batch} ...", flush=True)
            rows.append({"drafter": drafter, "batch": batch, **measure_apart(drafter, batch, child_argv(args), out)})
            # After every measurement, so a run cut short keeps the table of those done.
            write_report(out, "draft_host_time", {"settings": vars(args), "rows": rows}, table(rows))


def child_argv(args) -> list[str]:
    """The flags a measurement's own process needs: every setting of this run
    (not this process's command line, which a caller of ``main(argv)`` need
    not have: the children once got none, and measured in float32)."""
    argv = ["--dtype", args.dtype, "--max-tokens", str(args.max_tokens), "--nodes", str(args.nodes),
            "--warmup", str(args.warmup), "--steps", str(args.steps), "--head", str(args.head)]
    return argv + (["--prompts", str(args.prompts)] if args.prompts else [])


def measure_apart(drafter: str, batch: int, argv: list[str], out: Path) -> dict:
    """One measurement in a process of its own (``engines.run_apart``)."""
    return run_apart("draft_host_time", argv, out, f"{drafter}:{batch}", out / f"draft_host_time.{drafter}.{batch}.json")


if __name__ == "__main__":
    main()
