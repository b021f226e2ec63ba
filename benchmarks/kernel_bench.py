"""GPU timings of tree attention and KV compaction against what they replace.

Tree attention, on Llama-3-8B's attention (32 query heads, 8 KV heads, head
dim 128, cache blocks of 16 handed out in a shuffled order, bf16), for every
batch x context x tree size of ``--batches``, ``--contexts`` and ``--nodes``:

* ``kernels.tree_attention`` (the Triton kernel, given the batch's maximum
  lengths as an attention backend has them);
* its torch reference (where the padded float32 copy fits: batch x context up
  to 2**18 keys);
* FlexAttention with the tree as a block mask over contiguous KV (trees of
  more than one node, where the installed torch has it; compiled once per
  shape, before timing);
* unmasked SDPA over contiguous KV, a floor no masked kernel beats.

"% copy" is the unique bytes read (the requests' K and V, the queries) over the
kernel's time, as a share of what ``y.copy_(x)`` reaches on the same GPU in
the same run (bytes read plus written).

KV compaction: ``--compact-requests`` requests (256) with 8 accepted nodes each
out of 64-node trees, over 32 layers (one launch for all of them, as the
runner calls it), against the torch reference (one layer, timed once, times
32) and a vectorised torch gather/scatter per layer.

Kernel, SDPA, FlexAttention and gather/scatter times are GPU times, replayed
from a CUDA graph as vLLM runs its decode steps; "launched" adds the host's
launch cost (``do_bench`` on the Python call).

``--tune 32x4096x64,...`` first times the kernel's launch choices (query
tile, key tile, warps, pipeline stages, slices) on those shapes.

Medians of ``triton.testing.do_bench``. Needs a CUDA GPU (it says so and exits
otherwise); writes ``kernels.json`` and ``kernels.md`` in ``--out``.

Reproduce on a GPU machine (only torch and triton needed, no vLLM)::

    python3 -m benchmarks.kernel_bench --out /tmp/kernels   # from the repository root
    .venv/bin/vllm-adaptive-spec bench kernels --out /tmp/kernels   # where the package is installed
"""

from __future__ import annotations

import argparse
import itertools
import json
import time

import torch
import torch.nn.functional as F

from benchmarks.gpu_timing import bench, copy_bandwidth, graph_bench, require_cuda
from benchmarks.options import add_output
from benchmarks.report import write_report
from kernels.kv_compaction import compact_kv_reference, compact_kv_triton
from kernels.tree_attention import tree_attention_reference, tree_attention_triton
from vllm_adaptive_spec.trees.tree import ROOT, TreeBatch

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16
REFERENCE_MAX_KEYS = 1 << 18


def random_tree_masks(gen: torch.Generator, batch: int, nodes: int) -> torch.Tensor:
    """Ancestor-or-self masks of ``batch`` random breadth-first trees of ``nodes``."""
    parents = torch.full((batch, nodes), ROOT, dtype=torch.long)
    for node in range(1, nodes):  # breadth-first: a node's parent is at or after the previous node's
        low = parents[:, node - 1].clamp(min=0)
        parents[:, node] = low + (torch.rand(batch, generator=gen) * (node - low)).long()
    return TreeBatch(torch.zeros_like(parents), parents, torch.full((batch,), nodes)).ancestor_mask()


def attention_case(batch: int, context: int, nodes: int, seed: int = 0) -> dict:
    """One tree of ``nodes`` per request after ``context`` keys, in a paged bf16 cache."""
    gen = torch.Generator().manual_seed(seed)
    seq_len = context + nodes
    blocks = -(-seq_len // BLOCK)
    table = torch.randperm(batch * blocks, generator=gen).view(batch, blocks).int()
    masks = random_tree_masks(gen, batch, nodes)
    dev = "cuda"
    return dict(
        query=torch.randn(batch * nodes, HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16),
        key_cache=torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16),
        value_cache=torch.randn(batch * blocks, BLOCK, KV_HEADS, HEAD_DIM, device=dev, dtype=torch.bfloat16),
        block_table=table.to(dev),
        query_start_loc=torch.arange(0, batch * nodes + 1, nodes, dtype=torch.int32, device=dev),
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=dev),
        query_mask=masks.view(batch * nodes, nodes).to(dev),
        scale=HEAD_DIM**-0.5,
    ), masks.to(dev)


def contiguous_kv(case: dict, batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``[B, Hkv, S, D]`` key and value copies of the paged cache."""
    blocks = case["block_table"].long()
    return tuple(
        cache[blocks].reshape(batch, -1, KV_HEADS, HEAD_DIM)[:, :seq_len].transpose(1, 2).contiguous()
        for cache in (case["key_cache"], case["value_cache"])
    )


def flex_call(case: dict, masks: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, context: int):
    """A compiled FlexAttention call with the tree as a block mask, or None
    where the installed torch has no FlexAttention."""
    try:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention
    except ImportError:
        return None
    for limit in ("cache_size_limit", "recompile_limit"):  # one compile per shape
        if hasattr(torch._dynamo.config, limit):
            setattr(torch._dynamo.config, limit, 256)
    batch, nodes = masks.shape[:2]
    seq_len = keys.shape[2]

    def visible(b, h, q, kv):
        return (kv < context) | masks[b, q, (kv - context).clamp(min=0)]

    block_mask = create_block_mask(visible, batch, None, nodes, seq_len, device="cuda")
    compiled = torch.compile(flex_attention, dynamic=False)
    query = case["query"].view(batch, nodes, HEADS, HEAD_DIM).transpose(1, 2)
    error = None
    # torch 2.11 finds no decoding kernel for 64 queries x a group of 4: the
    # general template is then asked for, with smaller tiles as a last resort.
    for options in (None, {"FORCE_USE_FLEX_ATTENTION": True}, {"FORCE_USE_FLEX_ATTENTION": True, "BLOCK_M": 64, "BLOCK_N": 64}):
        def call(options=options):
            return compiled(query, keys, values, block_mask=block_mask, scale=case["scale"], enable_gqa=True,
                            kernel_options=options)
        try:
            call()
            return call
        except Exception as failure:  # the next options, then the last error
            error = failure
    raise error


def kernel_call(case: dict, batch: int, nodes: int, context: int, **launch):
    lengths = dict(max_query_len=nodes, max_seq_len=context + nodes)
    return lambda: tree_attention_triton(**case, **lengths, **launch)


def tune(bandwidth: float, shapes: list[tuple[int, int, int]]) -> list[dict]:
    """Time every launch choice on ``shapes``; the heuristic's own choice is ``{}``."""
    choices = [{}] + [dict(num_splits=k) for k in (1, 2, 4, 8)] + [
        dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
        for m, n, w, s in itertools.product((16, 64, 128), (32, 64, 128), (4, 8), (2, 3, 4))
    ]
    rows = []
    for batch, context, nodes in shapes:
        case, _ = attention_case(batch, context, nodes)
        read = unique_bytes(batch, context, nodes)
        for launch in choices:
            try:
                ms = graph_bench(kernel_call(case, batch, nodes, context, **launch), rep_ms=100)
            except Exception as error:  # an out-of-resources launch choice is reported, not fatal
                rows.append({"shape": [batch, context, nodes], "launch": launch, "error": str(error)[:200]})
                continue
            rows.append({"shape": [batch, context, nodes], "launch": launch, "us": 1e3 * ms,
                         "copy_fraction": read / (ms / 1e3) / bandwidth})
        del case
        torch.cuda.empty_cache()
    return rows


def unique_bytes(batch: int, context: int, nodes: int) -> int:
    """K and V of every request's keys, plus the queries and the output, in bf16."""
    return 2 * (2 * batch * (context + nodes) * KV_HEADS * HEAD_DIM + 2 * batch * nodes * HEADS * HEAD_DIM)


def attention_rows(bandwidth: float, batches, contexts, nodes_list, with_flex: bool) -> list[dict]:
    rows = []
    for batch, context, nodes in itertools.product(batches, contexts, nodes_list):
        case, masks = attention_case(batch, context, nodes)
        seq_len = context + nodes
        keys, values = contiguous_kv(case, batch, seq_len)
        row = {"batch": batch, "context": context, "nodes": nodes}
        kernel_ms = graph_bench(kernel_call(case, batch, nodes, context))
        row["kernel_us"] = 1e3 * kernel_ms
        row["copy_fraction"] = unique_bytes(batch, context, nodes) / (kernel_ms / 1e3) / bandwidth
        row["kernel_launched_us"] = 1e3 * bench(kernel_call(case, batch, nodes, context))
        if batch * seq_len <= REFERENCE_MAX_KEYS:
            expected = tree_attention_reference(**case)
            row["max_error_vs_reference"] = float((kernel_call(case, batch, nodes, context)().float() - expected.float()).abs().max())
            del expected
            row["reference_us"] = 1e3 * bench(lambda: tree_attention_reference(**case), rep_ms=100)
        query = case["query"].view(batch, nodes, HEADS, HEAD_DIM).transpose(1, 2)
        row["sdpa_unmasked_us"] = 1e3 * graph_bench(
            lambda: F.scaled_dot_product_attention(query, keys, values, scale=case["scale"], enable_gqa=True)
        )
        if with_flex and nodes > 1:
            try:
                started = time.perf_counter()
                call = flex_call(case, masks, keys, values, context)
                if call is not None:
                    torch.cuda.synchronize()
                    row["flex_compile_s"] = time.perf_counter() - started
                    try:
                        row["flex_us"] = 1e3 * graph_bench(call)
                    except RuntimeError:  # not capturable: timed with its launches
                        row["flex_us"], row["flex_timed_launched"] = 1e3 * bench(call), True
            except Exception as error:  # reported in the row: the kernel's numbers still count
                row["flex_error"] = str(error)[:300]
        rows.append(row)
        print(json.dumps(row), flush=True)
        del case, masks, keys, values
        torch.cuda.empty_cache()
    return rows


def compaction_case(requests: int, accepted: int, tree: int, layers: int, context: int = 256, seed: int = 0):
    """Per-layer bf16 caches and each request's ``accepted`` moves out of its ``tree`` nodes."""
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-(context + tree + 1) // BLOCK)
    table = torch.randperm(requests * blocks, generator=gen).view(requests, blocks)
    path = torch.stack([torch.randperm(tree, generator=gen)[:accepted].sort().values + 1 for _ in range(requests)])
    depth = torch.arange(1, accepted + 1).expand(requests, accepted)

    def slot(position):
        return table.gather(1, position // BLOCK) * BLOCK + position % BLOCK

    src, dst = slot(context + path).cuda(), slot(context + depth).cuda()
    caches = [
        (torch.randn(requests * blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16),
         torch.randn(requests * blocks, BLOCK, KV_HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16))
        for _ in range(layers)
    ]
    return caches, src, dst


def compaction_rows(bandwidth: float, requests: int, accepted: int = 8, tree: int = 64, layers: int = 32) -> list[dict]:
    caches, src, dst = compaction_case(requests, accepted, tree, layers)
    moved = (src != dst).sum().item()
    row_bytes = KV_HEADS * HEAD_DIM * 2
    traffic = 2 * 2 * moved * row_bytes * layers  # K and V, read and written

    keys, values = [k for k, _ in caches], [v for _, v in caches]

    def kernel():
        compact_kv_triton(keys, values, src, dst)

    src_block, src_offset, dst_block, dst_offset = src // BLOCK, src % BLOCK, dst // BLOCK, dst % BLOCK

    def gather_scatter():
        for key, value in caches:
            for cache in (key, value):
                cache[dst_block, dst_offset] = cache[src_block, src_offset]

    expected = [[c.clone()] for c in caches[-1]]
    compact_kv_reference(*expected, src, dst)
    kernel()
    exact = bool(torch.equal(caches[-1][0], expected[0][0]) and torch.equal(caches[-1][1], expected[1][0]))
    started = time.perf_counter()
    compact_kv_reference(*expected, src, dst)
    torch.cuda.synchronize()
    reference_us = 1e6 * (time.perf_counter() - started) * layers
    kernel_ms = graph_bench(kernel)
    return [{
        "requests": requests, "accepted": accepted, "tree": tree, "layers": layers, "moved_rows": moved,
        "kernel_us": 1e3 * kernel_ms, "copy_fraction": traffic / (kernel_ms / 1e3) / bandwidth,
        "kernel_launched_us": 1e3 * bench(kernel), "gather_scatter_us": 1e3 * graph_bench(gather_scatter),
        "reference_us": reference_us, "matches_reference": exact,
    }]


def goals(rows: list[dict]) -> list[str]:
    """The kernels' three goals (speed against torch, at every shape measured), read off the measured rows."""
    by_shape = {(r["batch"], r["context"], r["nodes"]): r for r in rows}
    lines = []
    for nodes in (16, 64):
        if (32, 4096, nodes) in by_shape:
            lines.append(f"- batch 32, context 4096, {nodes} nodes: {100 * by_shape[32, 4096, nodes]['copy_fraction']:.1f}% "
                         "of copy bandwidth (goal: 60%)")
    ratios = [(by_shape[b, c, 64]["kernel_us"] / by_shape[b, c, 1]["kernel_us"], b, c)
              for (b, c, n) in by_shape if n == 64 and (b, c, 1) in by_shape]
    if ratios:
        worst = max(ratios)
        lines.append(f"- 64-node tree over a 1-node query: at most {worst[0]:.2f}x (batch {worst[1]}, context {worst[2]}); "
                     "goal: 1.5x")
    flex = [r for r in rows if "flex_us" in r]
    slower = [f"({r['batch']}, {r['context']}, {r['nodes']})" for r in flex if r["kernel_us"] >= r["flex_us"]]
    if flex:
        lines.append(f"- faster than FlexAttention on {len(flex) - len(slower)} of {len(flex)} shapes"
                     + (f"; not on {', '.join(slower)}" if slower else ""))
    return lines


def markdown(report: dict) -> str:
    lines = [f"GPU: {report['gpu']}; copy bandwidth {report['copy_bandwidth_tb_s']:.2f} TB/s (read + written)", "",
             "Tree attention (32 query heads, 8 KV heads, head dim 128, blocks of 16, bf16); times in us:", "",
             "| batch | context | tree nodes | kernel | % copy | kernel, launched | torch reference "
             "| FlexAttention, tree mask | SDPA, no mask |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]

    def cell(row, key):
        return f"{row[key]:.0f}" if key in row else ""

    for row in report["attention"]:
        lines.append(f"| {row['batch']} | {row['context']} | {row['nodes']} | {row['kernel_us']:.0f} | "
                     f"{100 * row['copy_fraction']:.1f} | {cell(row, 'kernel_launched_us')} | {cell(row, 'reference_us')} | "
                     f"{cell(row, 'flex_us')} | "
                     f"{cell(row, 'sdpa_unmasked_us')} |")
    lines += ["", "KV compaction (bf16, 8 KV heads x 128, all layers in one launch); times in us:", "",
              "| requests | accepted each | layers | kernel | % copy | kernel, launched | torch gather/scatter "
              "| torch reference (loop) |",
              "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for row in report["compaction"]:
        lines.append(f"| {row['requests']} | {row['accepted']} | {row['layers']} | {row['kernel_us']:.0f} | "
                     f"{100 * row['copy_fraction']:.1f} | {row['kernel_launched_us']:.0f} | "
                     f"{row['gather_scatter_us']:.0f} | {row['reference_us']:.0f} |")
    lines += ["", *goals(report["attention"])]
    if report.get("tuning"):
        lines += ["", "Launch choices (us; {} is the heuristic's):", "", "| shape (batch, context, nodes) | launch | us | % copy |",
                  "|---|---|---:|---:|"]
        for row in report["tuning"]:
            if "us" in row:
                lines.append(f"| {tuple(row['shape'])} | {row['launch']} | {row['us']:.0f} | {100 * row['copy_fraction']:.1f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--nodes", default="1,16,64")
    parser.add_argument("--no-flex", action="store_true", help="skip FlexAttention (its compiles take a while)")
    parser.add_argument("--compact-requests", type=int, default=256)
    parser.add_argument("--tune", default="", metavar="BxCxN,...",
                        help="first sweep the kernel's launch choices on these shapes, e.g. 32x4096x64")
    add_output(parser)
    args = parser.parse_args(argv)
    require_cuda("benchmarks/kernel_bench.py")

    def ints(text):
        return [int(x) for x in text.split(",")]

    bandwidth = copy_bandwidth()
    report = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": bandwidth / 1e12,
              "torch": torch.__version__, "attention": [], "compaction": [], "tuning": []}
    if args.tune:
        report["tuning"] = tune(bandwidth, [tuple(ints(shape.replace("x", ","))) for shape in args.tune.split(",")])
        write_report(args.out, "kernels", report, markdown(report))  # the tuning kept if a later part fails
    report["compaction"] = compaction_rows(bandwidth, args.compact_requests)
    report["attention"] = attention_rows(bandwidth, ints(args.batches), ints(args.contexts), ints(args.nodes),
                                         not args.no_flex)
    write_report(args.out, "kernels", report, markdown(report))


if __name__ == "__main__":
    main()
