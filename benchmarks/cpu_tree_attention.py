"""The CPU tree paths against vLLM's CPU attention kernel, same rows.

On vLLM's CPU platform a request whose tree branches has its rows computed by
the plugin's native op (``kernels.tree_attention_cpu``) or, where that is not
built, its torch path (``adapter.attention_cpu.paged_tree_attention``); a
chain runs in vLLM's C++ kernel (``cpu_attention_with_kv_cache``), causal.
This times the three on the demo model's attention shape (3 KV heads, 9 query
heads, head dim 64, the cache blocks of 128 tokens the engine uses, shuffled;
``--dtype``, ``--threads``), per (batch, context, rows per request),
alternating them and keeping the best of ``--repeats`` timings of ``--calls``
calls: milliseconds per layer. The tree paths' rows here are a chain too (the
mask does not change their cost), so all compute the same outputs, which is
checked. A shape ``BxCxR+L`` adds one request of ``L`` keys beside the ``B``;
the torch path is also timed with every request in one group padded to the
longest (``plan_pages`` without ``max_keys``), the layout it groups requests
to avoid.

Reproduce (about a minute on 2 CPU cores; writes ``cpu_tree_attention.{json,md}``)::

    .venv/bin/vllm-adaptive-spec bench cpu-tree-attention --dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

from benchmarks.options import add_output
from benchmarks.report import write_report
from kernels.tree_attention_cpu import NativeRows, build, machine_isa, tree_attention_cpu
from vllm_adaptive_spec.adapter.attention_cpu import paged_tree_attention, plan_pages
from vllm_adaptive_spec.adapter.cpu_cache_layout import group_keys

KV_HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 128
SHAPES = "1x300x4,1x300x16,8x300x16,64x600x8,1x2000x16,16x400x6,30x500x17+2000"
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def _best_ms(call, calls: int, repeats: int) -> float:
    for _ in range(20):
        call()
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            call()
        best = min(best, (time.perf_counter() - started) / calls * 1e3)
    return best


def measure(batch: int, context: int, rows: int, calls: int, repeats: int, seed: int = 0, long: int = 0,
            dtype: torch.dtype = torch.float32) -> dict:
    from vllm import _custom_ops as ops

    generator = torch.Generator().manual_seed(seed)
    lengths = [context] * batch + ([long] if long else [])
    batch = len(lengths)
    blocks = -(-max(lengths) // BLOCK)
    num_blocks = batch * blocks + 4
    cache = torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=generator).to(dtype)
    block_table = torch.randperm(num_blocks, generator=generator)[: batch * blocks].view(batch, blocks).int()
    query_start_loc = torch.arange(0, batch * rows + 1, rows, dtype=torch.int32)
    seq_lens = torch.tensor(lengths, dtype=torch.int32)
    causal = torch.tril(torch.ones(rows, rows, dtype=torch.bool)).repeat(batch, 1)
    query = torch.randn(batch * rows, KV_HEADS * GROUP, HEAD_DIM, generator=generator).to(dtype)
    scale = HEAD_DIM ** -0.5
    plan = plan_pages(block_table, query_start_loc, seq_lens, causal, BLOCK, None, group_keys(cache))
    padded = plan_pages(block_table, query_start_loc, seq_lens, causal, BLOCK)
    metadata = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=batch, num_heads=KV_HEADS * GROUP, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, seq_lens=seq_lens,
        dtype=dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1, isa="vec",
        enable_kv_split=False,
    )
    key_cache, value_cache = cache.view(num_blocks, KV_HEADS, 2 * BLOCK, HEAD_DIM).chunk(2, dim=2)
    output = torch.empty_like(query)

    def kernel():
        ops.cpu_attention_with_kv_cache(
            query=query, key_cache=key_cache, value_cache=value_cache, output=output,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
        )

    op, native_rows = build(machine_isa()), NativeRows.of(block_table, query_start_loc, seq_lens, causal)

    def native():
        return tree_attention_cpu(op, query, cache, native_rows, scale)

    def tree_path():
        return paged_tree_attention(query, cache, plan, scale)

    def one_group():
        return paged_tree_attention(query, cache, padded, scale)

    kernel()
    difference = max(float((path() - output).abs().max()) for path in (native, tree_path, one_group))
    paths = {"native": native, "tree_path": tree_path, "vllm_kernel": kernel, "one_group": one_group}
    timings = {name: [] for name in paths}
    for _ in range(2):  # alternated: this machine's speed drifts
        for name, path in paths.items():
            timings[name].append(_best_ms(path, calls, repeats))
    best = {f"{name}_ms": min(times) for name, times in timings.items()}
    return {"batch": batch, "context": context, "long": long, "rows": rows, "groups": len(plan.groups), **best,
            "ratio": best["native_ms"] / best["vllm_kernel_ms"],
            "torch_ratio": best["tree_path_ms"] / best["vllm_kernel_ms"], "max_abs_difference": difference}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default=SHAPES, help="batch x context x rows per request, comma-separated")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    parser.add_argument("--threads", type=int, default=2, help="torch threads (every path's)")
    add_output(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = []
    for shape in args.shapes.split(","):
        shape, _, long = shape.partition("+")
        batch, context, rows = (int(v) for v in shape.split("x"))
        result = measure(batch, context, rows, args.calls, args.repeats, long=int(long or 0),
                         dtype=DTYPES[args.dtype])
        results.append(result)
        print(f"batch {result['batch']:3d} context {context:5d}{'+' + long if long else ''} rows {rows:3d}:"
              f" native {result['native_ms']:.3f} ms ({result['ratio']:.2f}x), torch path"
              f" {result['tree_path_ms']:.3f} ms ({result['torch_ratio']:.2f}x; {result['groups']} groups, one group"
              f" {result['one_group_ms']:.3f}), vLLM kernel {result['vllm_kernel_ms']:.3f} ms,"
              f" max |difference| {result['max_abs_difference']:.1e}", flush=True)
    lines = [f"{args.dtype}, {args.threads} threads, the native op built for {machine_isa()}", "",
             "| batch | context | rows | native ms | torch path ms | one group ms | vLLM kernel ms | native / vLLM |"
             " torch / native |", "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch']} | {r['context']}{'+' + str(r['long']) if r['long'] else ''} | {r['rows']} |"
              f" {r['native_ms']:.3f} | {r['tree_path_ms']:.3f} | {r['one_group_ms']:.3f} | {r['vllm_kernel_ms']:.3f} |"
              f" {r['ratio']:.2f} | {r['tree_path_ms'] / r['native_ms']:.1f} |" for r in results]
    settings = {"dtype": args.dtype, "threads": args.threads, "isa": machine_isa()}
    write_report(args.out, "cpu_tree_attention", {**settings, "results": results}, "\n".join(lines))


if __name__ == "__main__":
    main()
