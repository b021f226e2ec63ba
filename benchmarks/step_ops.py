"""The torch operations an engine step dispatches, by the code that dispatched
them (on the CPU every operation costs the host 2-3 microseconds
of dispatch, so a step's count is much of what the plugin adds to it, and on
a GPU each is a launch until the step is a graph).

For each ``--spec LABEL=JSON`` (a speculative config; ``null``: none),
``--batch-size`` prompts of the held-out set, greedy, ``--max-tokens``, the
engine in this process (each spec in a process of its own): after a warm-up
pass, every torch operation of one pass is counted under a
``TorchDispatchMode`` and charged to the innermost frame in the plugin or in
vLLM's runner, drafting, sampling and model code (:data:`SOURCES`). The
report: engine steps, operations a step in all, those in vLLM's model code
(``model_executor``: the target's and the draft model's forwards, the same
code on every side) and the rest, and the sources that dispatch the most a
step, per spec.

Reproduce (about 2 minutes on 2 CPU cores; the run of 2026-11-28 in
``benchmarks/results/history.md`` adds a third spec, the chain with
its layers at fixed capacity)::

    H=heads/smollm2-135m-eagle3
    .venv/bin/vllm-adaptive-spec bench step-ops --batch-size 1 \\
        --spec vllm-eagle3="{\\"method\\": \\"eagle3\\", \\"model\\": \\"$H\\", \\"num_speculative_tokens\\": 4}" \\
        --spec chain="{\\"method\\": \\"adaptive_tree\\", \\"num_speculative_tokens\\": 4, \\"model\\": \\"$H\\", \\"tree\\": {\\"drafter\\": \\"eagle3\\", \\"policy\\": \\"chain\\", \\"load_budget\\": \\"fixed\\"}}"
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys
from pathlib import Path

from benchmarks.engines import run_apart
from benchmarks.options import add_output, add_workload, parse_spec, positive_int
from benchmarks.report import write_report

# Code an operation is charged to: the innermost frame whose file path holds one of these.
SOURCES = ("vllm_adaptive_spec", "kernels/", "spec_decode", "v1/sample", "v1/worker", "model_executor")


def charged_frame(frame) -> str:
    """``path:function`` of the innermost frame in :data:`SOURCES`, or ``other``."""
    while frame is not None:
        path = frame.f_code.co_filename
        if any(source in path for source in SOURCES):
            for root in ("site-packages/", str(Path(__file__).resolve().parents[1]) + "/"):
                path = path.split(root)[-1]
            return f"{path}:{frame.f_code.co_name}"
        frame = frame.f_back
    return "other"


def count(spec: dict | None, args) -> dict:
    """One spec's pass, counted (this process)."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from vllm import LLM, SamplingParams

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.kv_cache_size import engine_kwargs
    from vllm_adaptive_spec.prompts import load_prompts

    torch.set_num_threads(1)
    prompts = [p.messages for p in load_prompts(args.prompts)]
    llm = LLM(**engine_kwargs(str(ensure_demo_model()), "float32", max_model_len=2048, max_num_seqs=args.batch_size,
                              speculative_config=spec))
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    llm.chat(prompts[-args.batch_size:], params, use_tqdm=False)
    runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
    execute, steps = runner.execute_model, [0]

    def counted_step(*a, **k):
        steps[0] += 1
        return execute(*a, **k)

    charged: collections.Counter = collections.Counter()

    class Charge(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            charged[charged_frame(sys._getframe(1))] += 1
            return func(*args, **(kwargs or {}))

    runner.execute_model = counted_step
    with Charge():
        outputs = llm.chat(prompts[: args.batch_size], params, use_tqdm=False)
    tokens = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"steps": steps[0], "tokens": tokens, "ops": sum(charged.values()), "by_source": dict(charged)}


def table(rows: list[dict], top: int) -> str:
    lines = ["| spec | steps | tokens | ops a step | of them, in the models (vLLM's `model_executor`) | the rest |",
             "|---|---:|---:|---:|---:|---:|"]
    for row in rows:
        if "error" in row:
            lines.append(f"| {row['label']} | {row['error']} | | | | |")
            continue
        steps = max(row["steps"], 1)
        model = sum(n for source, n in row["by_source"].items() if "model_executor/" in source)
        lines.append(f"| {row['label']} | {row['steps']} | {row['tokens']} | {row['ops'] / steps:.0f} | "
                     f"{model / steps:.0f} | {(row['ops'] - model) / steps:.0f} |")
    for row in rows:
        if "error" in row:
            continue
        lines += ["", f"{row['label']}: the sources dispatching the most operations a step", "",
                  "| source | ops a step |", "|---|---:|"]
        ranked = sorted(row["by_source"].items(), key=lambda item: -item[1])[:top]
        lines += [f"| `{source}` | {n / max(row['steps'], 1):.1f} |" for source, n in ranked]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=parse_spec, action="append", required=True, metavar="LABEL=JSON")
    parser.add_argument("--batch-size", type=positive_int, default=1)
    parser.add_argument("--top", type=positive_int, default=25, help="sources listed per spec")
    add_workload(parser, max_tokens=64)
    add_output(parser)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a spec's index, counted in this process
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process, under the dispatch mode
    args.out.mkdir(parents=True, exist_ok=True)
    if args.one is not None:
        label, spec = args.spec[int(args.one)]
        (args.out / f"step_ops.{args.one}.json").write_text(json.dumps(count(spec, args)) + "\n")
        return
    rows = []
    for index, (label, _) in enumerate(args.spec):
        print(f"{label} ...", flush=True)
        rows.append({"label": label, **count_apart(index, argv or [], args.out)})
    write_report(args.out, "step_ops", {"settings": {k: v for k, v in vars(args).items() if k != "spec"},
                                        "specs": dict(args.spec), "rows": rows}, table(rows, args.top))


def count_apart(index: int, argv: list[str], out: Path) -> dict:
    """One spec counted in a process of its own (``engines.run_apart``)."""
    return run_apart("step_ops", argv, out, str(index), out / f"step_ops.{index}.json")


if __name__ == "__main__":
    main()
