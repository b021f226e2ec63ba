"""What one more query row costs the target at batch 1.

A speculative step verifies ``1 + n`` rows of one request where a plain step
computes one; whether drafting ``n`` nodes can pay depends on how the step's
time grows with ``n``. This times vLLM itself (no plugin, no speculation):
one request whose context (``--context`` tokens, whole cache blocks) is in
the prefix cache, followed by ``T`` new tokens, one step for ``max_tokens=1``
(so ``T`` query rows over the cached context), for every ``T``:

* ``step``: the step's wall time, with logits for the last row only (a
  prompt chunk, as vLLM runs it);
* ``logits``: the model's ``compute_logits`` over ``T`` rows, timed in the
  worker, which verifying a tree of ``T - 1`` nodes needs beyond the step.

The table gives the fastest of ``--repeats`` runs per ``T`` (each step's
``T`` tokens differ, so nothing beyond the context is cached) and the fitted
slopes, the milliseconds per added row. The engine runs in-process
(the throughput benchmark's ``--engine-layout in-process``), float32.

Reproduce (about 2 minutes on 2 CPU cores; writes ``row_cost.{json,md}``)::

    .venv/bin/python benchmarks/row_cost.py
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BLOCK = 128


def slope(points: list[tuple[int, float]]) -> float:
    """Least-squares ms per row over ``(rows, ms)`` with ``rows >= 2``: the
    first row also pays the weights' read, the others only their compute."""
    xs = [x for x, _ in points if x >= 2]
    ys = [y for x, y in points if x >= 2]
    mean_x, mean_y = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def logits_ms(worker, rows: tuple[int, ...], repeats: int) -> dict[int, float]:
    """Runs in vLLM's worker (``collective_rpc``): the fastest ``compute_logits`` per row count."""
    import torch

    model = worker.model_runner.model
    hidden_size = model.config.hidden_size
    best = {}
    for count in rows:
        hidden = torch.randn(count, hidden_size, dtype=model.lm_head.weight.dtype)
        model.compute_logits(hidden)
        timings = []
        for _ in range(repeats):
            started = time.perf_counter()
            model.compute_logits(hidden)
            timings.append((time.perf_counter() - started) * 1e3)
        best[count] = min(timings)
    return best


def measure(context: int, rows: tuple[int, ...], repeats: int, dtype: str) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    # logits_ms is sent to the worker, which vLLM only pickles with this set.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    max_len = -(-(context + max(rows) + 1) // BLOCK) * BLOCK
    llm = LLM(**engine_kwargs(str(ensure_demo_model()), dtype, max_len, 1, None, block_size=BLOCK),
              distributed_executor_backend="uni", enable_prefix_caching=True)
    base = [100 + (i * 7919) % 40000 for i in range(context)]
    params = SamplingParams(max_tokens=1, temperature=0.0)
    llm.generate([TokensPrompt(prompt_token_ids=base)], params, use_tqdm=False)
    steps: dict[int, list[float]] = {}
    for repeat in range(repeats):
        for count in rows:
            tail = [200 + (j * 31 + repeat * 977) % 40000 for j in range(count)]
            started = time.perf_counter()
            llm.generate([TokensPrompt(prompt_token_ids=base + tail)], params, use_tqdm=False)
            steps.setdefault(count, []).append((time.perf_counter() - started) * 1e3)
    best = {"step": {count: min(values) for count, values in steps.items()},
            "logits": llm.collective_rpc(logits_ms, args=(rows, 3 * repeats))[0]}
    return {"context": context, "repeats": repeats, "dtype": dtype, "best_ms": best,
            "ms_per_row": {name: slope(sorted(by_rows.items())) for name, by_rows in best.items()}}


def markdown(report: dict) -> str:
    lines = [f"Batch 1, context {report['context']} tokens (prefix-cached), {report['dtype']}, "
             f"fastest of {report['repeats']} steps", "",
             "| rows | step (last row's logits), ms | logits of every row, ms |", "|---:|---:|---:|"]
    step, logits = report["best_ms"]["step"], report["best_ms"]["logits"]
    for count in step:
        lines.append(f"| {count} | {step[count]:.1f} | {logits[count]:.2f} |")
    lines.append(f"| ms per added row | {report['ms_per_row']['step']:.2f} | {report['ms_per_row']['logits']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=3 * BLOCK, help="cached context tokens (whole blocks)")
    parser.add_argument("--rows", default=",".join(map(str, ROWS)))
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"))
    args = parser.parse_args(argv)
    if args.context % BLOCK:
        parser.error(f"--context must be a multiple of {BLOCK} (whole cache blocks, so all of it is cached)")
    report = measure(args.context, tuple(int(r) for r in args.rows.split(",")), args.repeats, args.dtype)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "row_cost.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    text = markdown(report)
    (out / "row_cost.md").write_text(text, encoding="utf-8")
    print(text)


if __name__ == "__main__":
    main()
