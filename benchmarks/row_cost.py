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
(the throughput benchmark's ``--engine-layout in-process``), float32 by default.

``--batch-sizes`` also times steps of ``b`` such requests at once (the same
cached context, ``T`` new tokens each): the step cost per (batch, rows a
request) that a uniform tree step of width ``T - 1`` pays (the 8B model's
step-cost table), as a prompt-chunk step (PIECEWISE graphs on a GPU, where a uniform
tree step replays a FULL one: an upper bound by the launches).

``--shape llama3-8b`` times a model of Llama-3-8B's shape instead of the demo
model (random weights: vLLM's ``load_format="dummy"``, no tokenizer; use
``--dtype bfloat16`` on a GPU), the cost a GPU user's target would have.
``benchmarks/retrieval_calibration.py --row-cost row_cost.json`` replays the
retrieval trees at the measured costs.

Reproduce (about 2 minutes on 2 CPU cores; writes ``row_cost.{json,md}``)::

    .venv/bin/vllm-adaptive-spec bench row-cost
    # on a GPU: .venv/bin/vllm-adaptive-spec bench row-cost --shape llama3-8b --dtype bfloat16 --rows 1,2,4,8,16,32,48,64,96,128
    # the (batch, width) table: ... --shape llama3-8b --dtype bfloat16 --rows 1,3,5,9,17 --batch-sizes 1,8,32,64
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

from benchmarks import engine_worker
from benchmarks.options import OUT, add_batches, add_output, int_list
from benchmarks.report import write_report


ROWS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
BLOCK = 128
# Llama-3-8B's shape (random weights): what a GPU user's target costs.
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 128000, "eos_token_id": 128001,
}


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
    weight = model.lm_head.weight
    sync = torch.cuda.synchronize if weight.is_cuda else (lambda: None)
    for count in rows:
        hidden = torch.randn(count, hidden_size, dtype=weight.dtype, device=weight.device)
        model.compute_logits(hidden)
        timings = []
        for _ in range(repeats):
            sync()
            started = time.perf_counter()
            model.compute_logits(hidden)
            sync()
            timings.append((time.perf_counter() - started) * 1e3)
        best[count] = min(timings)
    return best


def model_path(shape: str, workdir: Path) -> tuple[str, dict]:
    """The model directory to time and the engine settings its shape needs."""
    if shape == "demo":
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        return str(ensure_demo_model()), {}
    directory = workdir / "llama3-8b-shape"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(LLAMA3_8B), encoding="utf-8")
    return str(directory), {"load_format": "dummy", "skip_tokenizer_init": True}


def measure(context: int, rows: tuple[int, ...], repeats: int, dtype: str, shape: str = "demo",
            workdir: Path = OUT, batch_sizes: tuple[int, ...] = (1,)) -> dict:
    # logits_ms is sent to the worker, which vLLM only pickles with this set.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    from vllm import SamplingParams

    model, settings = model_path(shape, workdir)
    max_len = -(-(context + max(rows) + 1) // BLOCK) * BLOCK
    largest = max(batch_sizes)
    job = {"model": model, "dtype": dtype, "max_model_len": max_len, "max_num_seqs": largest, "block_size": BLOCK,
           "engine_layout": "in-process"}
    llm = engine_worker.open_engine(job, enable_prefix_caching=True,
                                    max_num_batched_tokens=max(max_len, largest * max(rows)), **settings)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=shape == "demo")
    by_batch = {batch: _steps(llm, params, context, rows, repeats, batch) for batch in batch_sizes}
    first = 1 if 1 in by_batch else batch_sizes[0]
    best = {"step": by_batch[first],
            "logits": llm.collective_rpc(logits_ms, args=(rows, 3 * repeats))[0]}
    return {"shape": shape, "context": context, "repeats": repeats, "dtype": dtype, "batch": first, "best_ms": best,
            "ms_per_row": {name: slope(sorted(by_rows.items())) for name, by_rows in best.items()},
            "step_ms_by_batch": by_batch}


def _steps(llm, params, context: int, rows: tuple[int, ...], repeats: int, batch: int) -> dict[int, float]:
    """The fastest step of ``batch`` requests with ``T`` new tokens each over
    the cached context, per ``T`` in ``rows`` (every request's tokens differ)."""
    from vllm.inputs import TokensPrompt

    base = [100 + (i * 7919) % 40000 for i in range(context)]
    llm.generate([TokensPrompt(prompt_token_ids=base)], params, use_tqdm=False)
    steps: dict[int, list[float]] = {}
    for repeat in range(repeats):
        for count in rows:
            prompts = [TokensPrompt(prompt_token_ids=base + [200 + (j * 31 + (repeat * batch + r) * 977) % 40000
                                                             for j in range(count)]) for r in range(batch)]
            started = time.perf_counter()
            llm.generate(prompts, params, use_tqdm=False)
            steps.setdefault(count, []).append((time.perf_counter() - started) * 1e3)
    return {count: min(values) for count, values in steps.items()}


def replayed(by_batch: dict[int, dict[int, float]], results: list[dict]) -> list[dict]:
    """What each speculative method of a throughput run (``results``: the
    demo pair's acceptance) would give at this model's step costs: its tokens
    a drafting step (``tau``) over the step of its rows a request (one plus
    its mean drafts, rounded up to a timed row count), against a one-row
    step. The target's cost only: a drafter sized for this model costs more
    than the demo's."""
    out = []
    for row in results:
        spec, steps = row.get("spec") or {}, by_batch.get(row.get("batch_size"))
        if not spec.get("drafts") or not steps or 1 not in steps:
            continue
        width = 1 + spec["draft_tokens"] / spec["drafts"]
        rows = min((count for count in steps if count >= width), default=None)
        if rows is not None:
            out.append({"method": row["method"], "batch_size": row["batch_size"], "tau": row["tau"], "rows": rows,
                        "speedup": row["tau"] * steps[1] / steps[rows]})
    return out


def markdown(report: dict) -> str:
    lines = [f"{report.get('shape', 'demo')} model, batch {report.get('batch', 1)}, context {report['context']} tokens (prefix-cached), "
             f"{report['dtype']}, "
             f"fastest of {report['repeats']} steps", "",
             "| rows | step (last row's logits), ms | logits of every row, ms |", "|---:|---:|---:|"]
    step, logits = report["best_ms"]["step"], report["best_ms"]["logits"]
    for count in step:
        lines.append(f"| {count} | {step[count]:.1f} | {logits[count]:.2f} |")
    lines.append(f"| ms per added row | {report['ms_per_row']['step']:.2f} | {report['ms_per_row']['logits']:.2f} |")
    by_batch = report.get("step_ms_by_batch") or {}
    if len(by_batch) > 1:
        counts = list(next(iter(by_batch.values())))
        lines += ["", "Step ms by batch (rows) and rows a request (columns):", "",
                  "| batch | " + " | ".join(str(c) for c in counts) + " |", "|---:|" + "---:|" * len(counts)]
        lines += [f"| {batch} | " + " | ".join(f"{steps[c]:.1f}" for c in counts) + " |"
                  for batch, steps in by_batch.items()]
    if report.get("replayed"):
        lines += ["", "The throughput run's acceptance at these step costs (a drafting step's tokens over its "
                  "step, against a one-row step):", "", "| method | batch | tau | rows a request | speedup |",
                  "|---|---:|---:|---:|---:|"]
        lines += [f"| {r['method']} | {r['batch_size']} | {r['tau']:.2f} | {r['rows']} | {r['speedup']:.2f}x |"
                  for r in report["replayed"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=3 * BLOCK, help="cached context tokens (whole blocks)")
    parser.add_argument("--rows", type=int_list, default=list(ROWS),
                        help="row counts to time; two of them at least 2 (the slope leaves one row out)")
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--shape", choices=("demo", "llama3-8b"), default="demo",
                        help="the demo model, or Llama-3-8B's shape with random weights")
    add_batches(parser, "1")  # requests a step, each with the rows of --rows: the step cost per (batch, rows)
    parser.add_argument("--acceptance", type=Path,
                        help="a throughput.json (e.g. the demo pair's on the same GPU): each method's tau replayed "
                             "at these step costs")
    add_output(parser)
    args = parser.parse_args(argv)
    if args.context % BLOCK:
        parser.error(f"--context must be a multiple of {BLOCK} (whole cache blocks, so all of it is cached)")
    if len({r for r in args.rows if r >= 2}) < 2:
        parser.error("--rows needs two distinct counts of at least 2 (the ms per row is their slope)")
    args.out.mkdir(parents=True, exist_ok=True)
    report = measure(args.context, tuple(args.rows), args.repeats, args.dtype,
                     args.shape, args.out, tuple(args.batch_sizes))
    if args.acceptance is not None:
        results = json.loads(args.acceptance.read_text(encoding="utf-8"))["results"]
        report["replayed"] = replayed(report["step_ms_by_batch"], results)
    write_report(args.out, "row_cost", report, markdown(report))


if __name__ == "__main__":
    main()
