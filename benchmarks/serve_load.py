"""`vllm serve` under load and faults, without speculation and with one
or more speculative configs, on the same workload: what a production server
must survive, and whether speculation changes any answer.

The driver starts one server without speculation and one per ``--spec``
(each on its own port, all up at once), and sends each the same requests
(``--requests``, 1,000 by default, ``--concurrency`` 32 at a time), drawn
with ``--seed`` from the project's prompts, long prompts (several prompts in
one message) and prompts behind one shared system prompt (prefix-cache
hits), through the chat and completions APIs, streamed and not:

* greedy; temperature / top-p / top-k with and without a seed; ``n = 2``;
  ``logprobs = 5``; stop strings; presence / frequency / repetition
  penalties; JSON-schema structured output; ``min_p`` (temperature 0.8);
  greedy with ``logit_bias`` (which vLLM refuses under its own speculative
  methods); ``max_tokens`` from 1 to 512
  (log-uniform, within the model's length);
* a share of streamed requests whose client disconnects after a few chunks;
* a share of deliberately bad requests (a negative temperature), which must
  get a clear 4xx and nothing else;
* a KV cache of ``--kv-sequences`` full-length sequences, fewer than the
  requests in flight, so vLLM preempts.

Before the measured run each server answers ``--warmup`` requests (40) one
at a time, prompts of distinct lengths, so that vLLM's CPU matmul primitive
caches (oneDNN's capped at ``--onednn-primitive-cache`` primitives, see
``server_env``) are full before memory is read (see ``warmup_jobs``), then
``--batch-warmup`` requests (64) of the workload's mix on held-out prompts
at the run's concurrency, where the largest steps first appear (see
``batch_warmup_jobs``); the report gives each server's memory once up and
after the warm-up, then over the run.

Interleaved: the workload is cut into ``--blocks`` consecutive blocks, and
the servers take turns on each block (the order rotating), one server busy
at a time; a server's tok/s is its tokens over its own blocks' time, and the
ratio to no speculation is also given as the median of the per-block ratios.
This machine's speed drifts by 10-20% over minutes, which a server measured
after the other would take for its own. A ``--spec`` of ``null``
(``--spec control=null``) is a second server without speculation, a
*control*: its ratio to the first is the comparison's own noise.

It reports per request (status, tokens, finish reasons, TTFT, inter-token
and end-to-end latency), each speculative server's greedy token ids against
the server without speculation, latency percentiles and tok/s, the
spec-decode, preemption and prefix-cache counters from ``/metrics``, every server's memory
(the resident set of its process tree, and of its API server process alone)
over the run, and, with speculation, the plugin's per-request state once the
server is idle
(``adaptive_tree_stats`` through vLLM's development RPC endpoint): every
count must be zero; and the share of requests that received trees, by the
kind of sampling they asked for (structured output, penalties, the other
logits processors, plain). A plot shows latency, throughput and memory over the run
(``--out``/``serve_load.png``).

Decision: vLLM's ``vllm bench serve`` measures throughput and latency of one
server, but cannot send this mix of options, disconnect mid-stream, or
compare two servers' token ids, so the client is written here (aiohttp).

Chunked prefill on the CPU: vLLM 0.32 alone crashes there on a seeded
request whose prompt is chunked ("CPU Generator does not use offset"); the
plugin's runner handles it. So on the CPU every server runs without chunked
prefill by default (like for like), and ``--chunked-spec`` turns it on for
the speculative servers (the plugin then serves chunked seeded prompts; the
tok/s ratio then compares unlike settings). On CUDA every server chunks.

Reproduce (CPU; the default retrieval tree and the hybrid, about 40 minutes on 2 cores)::

    .venv/bin/vllm-adaptive-spec bench serve-load --spec retrieval='{"method": "adaptive_tree",
        "num_speculative_tokens": 16, "tree": {"drafter": "retrieval"}}' --spec hybrid='{"method":
        "adaptive_tree", "num_speculative_tokens": 24, "model": "heads/smollm2-135m-eagle3",
        "tree": {"drafter": "hybrid"}}' --out benchmarks/out/serve_load
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.options import REPO, add_output, add_workload, parse_spec
from benchmarks.report import write_report
from benchmarks.serving.serve_report import greedy_comparison, markdown, plot, summarize
from benchmarks.serving.servers import run_servers
from benchmarks.serving.workload import DEFAULT_SPEC, PLAIN, batch_warmup_jobs, warmup_jobs, workload


def server_args(model: str, max_model_len: int, kv_sequences: int, dtype: str, spec: dict | None,
                chunked: bool, block_size: int | None = None) -> list[str]:
    from vllm_adaptive_spec.kv_cache_size import DEFAULT_BLOCK_SIZE, kv_cache_bytes

    kv = kv_cache_bytes(model, max_model_len=max_model_len, max_num_seqs=kv_sequences, dtype=dtype,
                        speculative_config=spec, block_size=block_size or DEFAULT_BLOCK_SIZE)
    args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv),
            "--max-num-seqs", "64", "--seed", "0"]
    if block_size:
        args += ["--block-size", str(block_size)]
    try:
        import torch

        if not torch.cuda.is_available():
            args.append("--enforce-eager")
    except ImportError:
        pass
    if not chunked:
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
    return args


@dataclass
class ServeLoadConfig:
    """One serve-load run. ``specs``: label -> speculative config, each
    served beside no speculation. Each server's KV cache holds
    ``kv_sequences`` full-length sequences of its own config (lookahead
    slots and draft layers included); the server without speculation
    ``reference_kv_sequences`` where given (a reference that does not
    preempt answers sooner; its tok/s then compares unlike settings). Each
    server first answers ``warmup`` requests one at a time and then
    ``batch_warmup`` of the workload's mix at ``concurrency``
    (``workload.warmup_jobs``, ``workload.batch_warmup_jobs``).
    ``block_size``: vLLM's KV block size (its platform's default when None;
    smaller blocks make a request need a new one more often, so a small KV
    cache preempts more). ``extra_args`` go to every server's ``vllm serve``
    (with ``--distributed-executor-backend uni`` each server's worker runs in
    its engine core process: one vLLM import fewer to start).
    ``primitive_cache``: oneDNN's primitive cache capacity in every server
    (``servers.server_env``; 0: oneDNN's default). ``prompts``: the
    measured requests' prompt set (None: the project's prompts)."""

    model: str
    specs: dict[str, dict]
    out: Path
    requests: int = 1000
    concurrency: int = 32
    seed: int = 0
    max_model_len: int = 2048
    kv_sequences: int = 3
    dtype: str = "float32"
    max_tokens_cap: int = 512
    blocks: int = 10
    chunked_spec: bool = False
    warmup: int = 0
    reference_kv_sequences: int | None = None
    block_size: int | None = None
    extra_args: list[str] = field(default_factory=list)
    batch_warmup: int = 0
    primitive_cache: int = 0
    prompts: Path | None = None


def compare(config: ServeLoadConfig) -> dict:
    """Every server on one workload, interleaved; the whole report."""
    c = config
    model, specs, out, max_model_len = c.model, c.specs, c.out, c.max_model_len
    out.mkdir(parents=True, exist_ok=True)
    jobs = workload(c.requests, c.seed, max_model_len, model, c.max_tokens_cap, c.prompts)
    try:
        import torch

        cpu = not torch.cuda.is_available()
    except ImportError:
        cpu = True
    all_specs = {PLAIN: None, **specs}
    args_of = {label: server_args(model, max_model_len,
                                  c.reference_kv_sequences if label == PLAIN and c.reference_kv_sequences
                                  else c.kv_sequences,
                                  c.dtype, spec, chunked=not cpu or (spec is not None and c.chunked_spec),
                                  block_size=c.block_size) + list(c.extra_args)
               for label, spec in all_specs.items()}
    runs = run_servers(all_specs, args_of, model, jobs, c.concurrency, c.blocks, out,
                       warmup_jobs(c.warmup, max_model_len, model) if c.warmup else [],
                       batch_warmup_jobs(c.batch_warmup, max_model_len, model, c.max_tokens_cap)
                       if c.batch_warmup else [],
                       c.primitive_cache)
    summaries = {label: summarize(run, jobs) for label, run in runs.items()}
    report = {
        "requests": c.requests, "concurrency": c.concurrency, "seed": c.seed, "blocks": c.blocks,
        "warmup": c.warmup, "batch_warmup": c.batch_warmup,
        "spec_configs": specs,
        "note": _note(c, cpu), "servers": summaries, "ratios": _ratios(runs, summaries, specs),
        "greedy": {label: greedy_comparison(runs[PLAIN], runs[label], jobs) for label in specs},
    }
    write_report(out, "serve_load", {**report, "runs": runs}, markdown(report), plot)
    return report


def _ratios(runs: dict, summaries: dict, specs: dict) -> dict:
    """Each speculative server's tok/s against the plain one's: by block, their median, and in total."""
    plain, ratios = runs[PLAIN], {}
    for label in specs:
        per_block = [(t / w) / (pt / pw) for t, w, pt, pw in zip(runs[label]["block_tokens"], runs[label]["block_wall_s"],
                                                                 plain["block_tokens"], plain["block_wall_s"])]
        ratios[label] = {"blocks": per_block, "median": statistics.median(per_block),
                         "total": summaries[label]["tok_per_s"] / summaries[PLAIN]["tok_per_s"]}
    return ratios


def _note(c: ServeLoadConfig, cpu: bool) -> str:
    """What the servers' settings differ in, and the CPU's allocator and oneDNN cache."""
    if not cpu:
        note = "every server with chunked prefill"
    elif c.chunked_spec:
        note = ("CPU: the speculative servers with chunked prefill, the server without speculation without it (vLLM "
                "0.32 alone crashes on a seeded request whose prompt is chunked): tok/s compares unlike settings")
    else:
        note = "CPU: every server without chunked prefill (vLLM 0.32 alone crashes on a chunked seeded prompt)"
    if c.reference_kv_sequences:
        note += (f"; the server without speculation with KV for {c.reference_kv_sequences} sequences, "
                 f"the others {c.kv_sequences}")
    if cpu:
        note += f"; memory allocator: {allocator()}; oneDNN primitive cache: " + (
            f"{c.primitive_cache} primitives" if c.primitive_cache > 0 else "oneDNN's default (1,024)")
    return note


def allocator() -> str:
    """The servers' memory allocator, as they inherit it: tcmalloc where
    ``LD_PRELOAD`` names it (vLLM's recommendation for its CPU build), else
    the C library's malloc, under which the servers' memory grows with the
    oneDNN matmul primitives vLLM creates (docs/benchmarking.md)."""
    return "tcmalloc (LD_PRELOAD)" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "the C library's malloc"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default: the demo model")
    parser.add_argument("--spec", type=parse_spec, action="append", metavar="[LABEL=]JSON",
                        help="a speculative config, served beside no speculation (repeatable; null: a control server "
                             "without speculation; default: "
                             f"retrieval={json.dumps(DEFAULT_SPEC)})")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=10, help="the servers take turns on this many blocks")
    parser.add_argument("--chunked-spec", action="store_true",
                        help="CPU: chunked prefill on for the speculative servers (off for every server by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-sequences", type=int, default=3,
                        help="the KV cache holds this many full-length sequences (3: about the default workload's "
                             "32 requests in flight, so vLLM preempts some; 6 never did)")
    parser.add_argument("--warmup", type=int, default=40,
                        help="requests of distinct prompt lengths each server answers, one at a time, before the "
                             "measured run (fills vLLM's CPU matmul primitive caches; 0: none)")
    parser.add_argument("--batch-warmup", type=int, default=64,
                        help="then requests of the workload's mix on the held-out prompts at --concurrency, not "
                             "measured (a server's step-sized buffers and batched matmul primitives; 0: none)")
    parser.add_argument("--block-size", type=int,
                        help="vLLM's KV block size (default the platform's: 128 on the CPU); smaller blocks are "
                             "asked for more often, so a small KV cache preempts more")
    parser.add_argument("--onednn-primitive-cache", type=int, default=128,
                        help="CPU: every server's oneDNN primitive cache capacity (ONEDNN_PRIMITIVE_CACHE_CAPACITY; "
                             "128 bounds vLLM's matmul primitives once the warm-up has run; 0: oneDNN's default, "
                             "1,024, under which memory grows for thousands of seconds)")
    parser.add_argument("--dtype", default="float32")
    add_workload(parser, max_tokens=512, prompts=None)  # max_tokens drawn log-uniform up to this
    add_output(parser, "serve_load")
    args = parser.parse_args(argv)
    specs = dict(args.spec) if args.spec else {"retrieval": DEFAULT_SPEC}
    if PLAIN in specs:
        parser.error(f"{PLAIN!r} is the server without speculation; give the config another label")
    if args.model is None:
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    for spec in specs.values():  # a head or draft model given relative to the repository
        if spec and spec.get("model") and not Path(spec["model"]).is_absolute() and (REPO / spec["model"]).exists():
            spec["model"] = str(REPO / spec["model"])
    compare(ServeLoadConfig(
        args.model, specs, args.out, requests=args.requests, concurrency=args.concurrency, seed=args.seed,
        max_model_len=args.max_model_len, kv_sequences=args.kv_sequences, dtype=args.dtype,
        max_tokens_cap=args.max_tokens, blocks=args.blocks, chunked_spec=args.chunked_spec, warmup=args.warmup,
        block_size=args.block_size, batch_warmup=args.batch_warmup, primitive_cache=args.onednn_primitive_cache,
        prompts=args.prompts))


if __name__ == "__main__":
    main()
