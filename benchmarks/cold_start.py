"""What a fresh engine pays once: its first pass against the same pass warm.

For no speculation and each ``--spec``: a fresh in-process engine (one
subprocess each, one after another) answers the same prompts ``--passes``
times (greedy, up to ``--max-tokens``, ``--batch`` requests in flight), the
prefix cache reset before every pass, so each pass does the same work and the
first pass's extra time is what a fresh engine pays before it is warm: the
load budget's first judgements (a model drafter's trial trees), and on the CPU
the oneDNN matmul primitives vLLM creates for each new pair of weight shape
and row count (``new shapes``: (N, K, M) triples first seen in the pass).

Per method: each pass's seconds, ``cold``: the first pass over the mean of
the others, and the plugin's counters per pass (draft passes, drafting and
paused steps, probes). Outputs in ``--out``: ``cold_start.json`` and
``cold_start.md``.

Reproduce (the hybrid with the project's EAGLE-3 head, 32 requests at once)::

    .venv/bin/vllm-adaptive-spec bench cold-start --spec hybrid='{"method": "adaptive_tree",
        "num_speculative_tokens": 24, "model": "heads/smollm2-135m-eagle3", "tree": {"drafter": "hybrid"}}'
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from benchmarks import engine_worker, engines
from benchmarks.options import add_output, add_workload, parse_spec
from benchmarks.report import fmt, installed_vllm_version, machine, machine_line, write_report


def count_new_shapes() -> set | None:
    """Wrap vLLM's CPU oneDNN matmul so each call's (N, K, M) is recorded;
    the returned set fills as the engine runs (None where vLLM has no oneDNN path)."""
    try:
        from vllm import _custom_ops as ops
    except ImportError:
        return None
    if not getattr(ops, "_supports_onednn", False):
        return None
    seen: set = set()
    inner = ops.onednn_mm

    def onednn_mm(handler, x, bias):
        seen.add((handler.n, handler.k, x.numel() // handler.k))
        return inner(handler, x, bias)

    ops.onednn_mm = onednn_mm
    return seen


def one_method(args, label: str, spec: dict | None) -> dict:
    """Run in a subprocess: the passes of one fresh engine."""
    shapes = count_new_shapes()
    from vllm import SamplingParams

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    model = args.model or str(ensure_demo_model())
    job, _ = engines.greedy_job(model, load_prompts(args.prompts), args.dtype, args.max_tokens, [args.batch],
                                [args.num_prompts])
    job["speculative_config"] = spec
    llm = engine_worker.open_engine(job)
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    conversations = job["conversations"][: args.num_prompts]
    tree_method = spec is not None and engine_worker.is_tree_method(job)
    passes, before = [], engine_worker.tree_counters(llm, tree_method)
    for _ in range(args.passes):
        llm.reset_prefix_cache()
        known = len(shapes) if shapes is not None else 0
        started = time.perf_counter()
        outputs = engine_worker.generate(llm, conversations, params, args.batch, args.batch)
        seconds = time.perf_counter() - started
        after = engine_worker.tree_counters(llm, tree_method)
        passes.append({"seconds": seconds, "tokens": sum(len(o.outputs[0].token_ids) for o in outputs),
                       "new_shapes": None if shapes is None else len(shapes) - known,
                       "counters": {k: after[k] - before.get(k, 0) for k in after}})
        before = after
    warm = [p["seconds"] for p in passes[1:]]
    return {"label": label, "spec": spec, "passes": passes,
            "cold": passes[0]["seconds"] / (sum(warm) / len(warm))}


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# A fresh engine's first pass", "",
        f"{s['num_prompts']} prompts of {Path(s['prompts']).name}, {s['batch']} in flight, greedy, "
        f"max_tokens={s['max_tokens']}, {s['passes']} passes per engine, prefix cache reset before each; "
        f"vLLM {report['vllm_version']}, {machine_line(report['machine'])}", "",
        "| method | seconds per pass | cold (first / warm mean) | new shapes per pass | draft passes per pass |",
        "|---|---|---:|---|---|",
    ]
    for r in report["rows"]:
        if r.get("error"):
            lines.append(f"| {r['label']} | error: {r['error']} | | | |")
            continue
        passes = r["passes"]
        lines.append(
            f"| {r['label']} | {' / '.join(fmt(p['seconds']) for p in passes)} | {fmt(r['cold'])}x | "
            f"{' / '.join(str(p['new_shapes']) for p in passes)} | "
            f"{' / '.join(str(p['counters'].get('draft_passes', '')) for p in passes)} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spec", type=parse_spec, action="append", default=[],
                        help="LABEL=JSON speculative config (repeatable); no speculation always runs first")
    parser.add_argument("--model", help="default: the demo model")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--passes", type=int, default=3)
    add_workload(parser, max_tokens=96)
    add_output(parser, "cold_start")
    parser.add_argument("--one", nargs=2, metavar=("LABEL", "JSON"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.passes < 2:
        parser.error("--passes must be at least 2 (the first pass is compared with the others)")
    if args.one:
        print("COLD_START " + json.dumps(one_method(args, args.one[0], json.loads(args.one[1]))), flush=True)
        return
    rows = []
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
                 if k not in ("spec", "one", "out") and v is not None]
    for label, spec in [("none", None), *args.spec]:
        done = subprocess.run([sys.executable, __file__, *forwarded, "--one", label, json.dumps(spec)],
                              capture_output=True, text=True)
        lines = [line for line in done.stdout.splitlines() if line.startswith("COLD_START ")]
        if lines:
            rows.append(json.loads(lines[-1].removeprefix("COLD_START ")))
        else:
            raised = engines.last_error_line(done.stderr.splitlines())
            rows.append({"label": label, "spec": spec, "error": raised or f"exit {done.returncode}"})
        print(label, rows[-1].get("error") or fmt(rows[-1]["cold"]), flush=True)
    settings = {k: v for k, v in vars(args).items() if k not in ("spec", "one", "out")}
    report = {"settings": settings, "vllm_version": installed_vllm_version(), "machine": machine(),
              "rows": rows}
    write_report(args.out, "cold_start", report, markdown(report))


if __name__ == "__main__":
    main()
