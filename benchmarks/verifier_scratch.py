"""Peak memory and time of the verifier drawing a step's tree-row targets.

Draws the targets of ``--requests`` requests of ``--rows`` logits rows each
(the demo model's 49,152-token vocabulary) through
``adapter.verifier.tree_row_targets``, greedy or with half the requests
sampled (temperature 0.8, top-k 50, top-p 0.9), and prints the process's peak
RSS over its inputs (``ru_maxrss``; one draw per process, so each setting
runs in a process of its own) and the draw's time.

Reproduce (from the repository root)::

    for chunk in 100000 256 128 64; do
        .venv/bin/vllm-adaptive-spec bench verifier-scratch --mixed --max-rows $chunk
    done
    .venv/bin/vllm-adaptive-spec bench verifier-scratch --requests 64
"""

from __future__ import annotations

import argparse
import resource
import time

from benchmarks.options import add_output
from benchmarks.report import write_report


def sampling_metadata(batch: int, mixed: bool):
    import torch
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    temperature = torch.full((batch,), 0.8 if mixed else 0.0)
    temperature[::2] = 0.0
    return SamplingMetadata(
        temperature=temperature, all_greedy=not mixed, all_random=False,
        top_p=torch.full((batch,), 0.9), top_k=torch.full((batch,), 50, dtype=torch.int32),
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch), presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch), output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None, bad_words_token_ids={}, logitsprocs=LogitsProcessors(),
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=32)
    parser.add_argument("--rows", type=int, default=17, help="logits rows a request (its tree's nodes + 1)")
    parser.add_argument("--vocab", type=int, default=49152)
    parser.add_argument("--mixed", action="store_true", help="half the requests sampled (default: all greedy)")
    parser.add_argument("--max-rows", type=int, default=None, help="chunk bound (default: the verifier's)")
    add_output(parser)
    args = parser.parse_args(argv)

    import torch

    from vllm_adaptive_spec.adapter.verifier import MAX_CHUNK_ROWS, tree_row_targets

    max_rows = args.max_rows or MAX_CHUNK_ROWS
    logits = torch.randn(args.requests * args.rows, args.vocab)
    meta = sampling_metadata(args.requests, args.mixed)
    starts = list(range(0, args.requests * args.rows, args.rows))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    begin = time.perf_counter()
    tree_row_targets(logits, starts, list(range(args.requests)), [args.rows] * args.requests, meta, max_rows=max_rows)
    elapsed = time.perf_counter() - begin
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    kind = "mixed" if args.mixed else "greedy"
    report = {"requests": args.requests, "rows": args.rows, "vocab": args.vocab, "kind": kind, "max_rows": max_rows,
              "peak_rss_mb": peak, "ms": elapsed * 1e3}
    write_report(args.out, "verifier_scratch", report,
                 f"{args.requests} x {args.rows} rows, {kind}, chunks of {max_rows}: peak RSS +{peak:.0f} MB, "
                 f"{elapsed * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
