"""Tree attention: the Triton kernel (on CUDA tensors where a GPU is present,
interpreted elsewhere) against the torch reference, and the reference against
a dense computation."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from kernels.tree_attention import (
    causal_query_mask,
    tree_attention,
    tree_attention_reference,
    tree_attention_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_tree_mask(gen: torch.Generator, size: int) -> torch.Tensor:
    """Ancestor-or-self mask of a random tree whose nodes are in breadth-first order."""
    mask = torch.eye(size, dtype=torch.bool)
    parent = 0
    for node in range(1, size):
        parent = int(torch.randint(parent, node, (1,), generator=gen))
        mask[node] |= mask[parent]
    return mask


def make_case(
    requests: list[tuple[int, str | int]],
    *,
    num_heads: int = 2,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    transposed: tuple[bool, bool] = (False, False),
    seed: int = 0,
) -> dict:
    """Inputs for ``requests``, each (context length, causal query length or "tree:N").

    Blocks are handed out in a shuffled order, spare blocks hold noise, and the
    mask's columns past each request's query length are set to True to check
    they are ignored. ``transposed`` says which of the key and value caches are
    views of ``[num_blocks, Hkv, D, block_size]`` storage.
    """
    gen = torch.Generator().manual_seed(seed)
    q_lens = [q if isinstance(q, int) else int(q.split(":")[1]) for _, q in requests]
    seq_lens = [ctx + q for (ctx, _), q in zip(requests, q_lens)]
    blocks_per_req = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max(blocks_per_req)
    num_blocks = sum(blocks_per_req) + 3
    physical = torch.randperm(num_blocks, generator=gen).int()
    block_table = torch.zeros(len(requests), max_blocks, dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_req):
        block_table[b, :n] = physical[used : used + n]
        used += n

    caches = []
    for t in transposed:
        if t:
            storage = torch.randn(num_blocks, num_kv_heads, head_dim, block_size, generator=gen)
            caches.append(storage.to(dtype).permute(0, 3, 1, 2))
        else:
            caches.append(torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype))

    width = max(q_lens) + 2
    rows = []
    for (_, kind), q_len in zip(requests, q_lens):
        mask = torch.ones(q_len, width, dtype=torch.bool)
        if isinstance(kind, str):
            mask[:, :q_len] = random_tree_mask(gen, q_len)
        else:
            mask[:, :q_len] = torch.ones(q_len, q_len, dtype=torch.bool).tril()
        rows.append(mask)

    case = dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype),
        key_cache=caches[0],
        value_cache=caches[1],
        block_table=block_table,
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_mask=torch.cat(rows),
    )
    return {name: tensor.to(DEVICE) for name, tensor in case.items()} | {"scale": head_dim**-0.5}


# With blocks of 4: context 5 (mid-block) with a tree ending on a block boundary,
# context 8 (ends on a boundary) with one token, a causal prefill of 13 without
# context, context 11 with a tree, and another lone decode token.
RAGGED = [(5, "tree:7"), (8, 1), (0, 13), (11, "tree:5"), (3, 1)]
# Longer contexts, for whole unmasked context tiles and slices of several
# tiles that cut cache blocks: a 9-node tree after 70 keys, and a causal
# request of 4 after 33, shorter than one slice of 48 keys (its later slices
# are empty). Two requests only: the interpreter pays for every program.
LONG = [(70, "tree:9"), (33, 4)]

SHAPES = {
    "group1-d16": dict(num_heads=2, num_kv_heads=2),
    "group4-d64": dict(num_heads=8, num_kv_heads=2, head_dim=64),
    "group8-d128-key-transposed": dict(num_heads=8, num_kv_heads=1, head_dim=128, transposed=(True, False), seed=1),
    "group2-d24-both-transposed": dict(num_heads=4, num_kv_heads=2, head_dim=24, transposed=(True, True), seed=2),
}
TOLERANCE = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.bfloat16: dict(atol=2e-2, rtol=2e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=list(SHAPES))
def test_triton_matches_reference(shape, dtype):
    """Ragged trees and causal rows in blocks of 4, in key tiles of 16 and in
    the heuristic's choice of tiles. At most 16 keys a request: one slice
    whatever is asked (slices are whole tiles), so the slices and their merge
    are the LONG tests' part."""
    case = make_case(RAGGED, dtype=dtype, **SHAPES[shape])
    expected = tree_attention_reference(**case)
    for launch in (dict(block_n=16, num_splits=1), dict()):
        out = tree_attention_triton(**case, **launch)
        assert out.dtype == dtype
        torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_slices_cutting_blocks_and_several_query_tiles(dtype):
    """Blocks of 32 read in slices of 48 keys, and query tiles of 16 packed
    (row, head) pairs, so a 9-node tree of a group of 4 spans three tiles
    (the other request's one tile leaves two programs with no rows). A head
    size of 24 in 32 lanes: both kernels mask the head dimension."""
    case = make_case(LONG, num_heads=8, num_kv_heads=2, head_dim=24, block_size=32, dtype=dtype, seed=5)
    expected = tree_attention_reference(**case)
    for launch in (dict(block_n=16, num_splits=2), dict(block_n=16, num_splits=2, block_m=16), dict(block_m=16)):
        torch.testing.assert_close(tree_attention_triton(**case, **launch), expected, **TOLERANCE[dtype])


def test_launch_shape_does_not_change_float32_results():
    """The max lengths given by the caller, as an attention backend does,
    give the result of the ones read off the device."""
    case = make_case(LONG, num_heads=4, num_kv_heads=1, block_size=16, seed=6)
    lengths = dict(max_query_len=int(case["query_start_loc"].diff().max()), max_seq_len=int(case["seq_lens"].max()))
    torch.testing.assert_close(
        tree_attention_triton(**case, **lengths), tree_attention_triton(**case), atol=1e-6, rtol=1e-6
    )


@pytest.mark.parametrize("seed", range(3))
def test_random_trees(seed):
    case = make_case([(6, "tree:9"), (4, "tree:12"), (9, "tree:3")], seed=seed, block_size=8)
    torch.testing.assert_close(tree_attention_triton(**case, num_splits=2), tree_attention_reference(**case), atol=1e-5, rtol=1e-5)


def test_tree_mask_matters():
    case = make_case([(6, "tree:9"), (4, "tree:12")], seed=3)
    all_visible = dict(case, query_mask=torch.ones_like(case["query_mask"]))
    tree_out = tree_attention_triton(**case)
    assert not torch.allclose(tree_out, tree_attention_reference(**all_visible), atol=1e-3)
    assert not torch.allclose(tree_out, tree_attention_triton(**all_visible), atol=1e-3)


@pytest.mark.parametrize("context", [0, 7])
def test_reference_matches_dense_causal_attention(context):
    q_len, heads, head_dim, block_size = 6, 2, 16, 4
    gen = torch.Generator().manual_seed(context)
    seq_len = context + q_len
    query = torch.randn(q_len, heads, head_dim, generator=gen)
    keys, values = torch.randn(2, seq_len, heads, head_dim, generator=gen)

    num_blocks = math.ceil(seq_len / block_size)
    block_table = torch.randperm(num_blocks, generator=gen).int()[None]
    caches = torch.zeros(2, num_blocks, block_size, heads, head_dim)
    for pos in range(seq_len):
        caches[:, block_table[0, pos // block_size], pos % block_size] = torch.stack([keys[pos], values[pos]])
    query_start_loc = torch.tensor([0, q_len], dtype=torch.int32)

    out = tree_attention_reference(
        query,
        caches[0],
        caches[1],
        block_table,
        query_start_loc,
        torch.tensor([seq_len], dtype=torch.int32),
        causal_query_mask(query_start_loc, q_len),
        head_dim**-0.5,
    )

    q, k, v = (x.transpose(0, 1) for x in (query, keys, values))
    if context == 0:
        dense = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    else:
        prefix_causal = torch.ones(q_len, seq_len, dtype=torch.bool).tril(diagonal=context)
        dense = F.scaled_dot_product_attention(q, k, v, attn_mask=prefix_causal)
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


def test_causal_query_mask():
    mask = causal_query_mask(torch.tensor([0, 1, 4], dtype=torch.int32), 4)
    expected = torch.tensor(
        [
            [1, 0, 0, 0],
            [1, 0, 0, 0],
            [1, 1, 0, 0],
            [1, 1, 1, 0],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask, expected)


def test_dispatch_picks_the_kernel_on_cuda_and_the_reference_elsewhere():
    case = make_case([(3, "tree:4")])
    expected = tree_attention_triton if DEVICE == "cuda" else tree_attention_reference
    assert torch.equal(tree_attention(**case), expected(**case))


def test_rows_seeing_only_themselves():
    """Each row attends to its own key alone, so it returns that key's value; a
    row's first tiles are then fully masked."""
    case = make_case([(0, "tree:12"), (0, 3)], num_heads=4, num_kv_heads=2, block_size=4, seed=4)
    case["query_mask"] = torch.eye(12, dtype=torch.bool, device=DEVICE)[[*range(12), *range(3)]]
    out = tree_attention_triton(**case, block_n=16, num_splits=2)
    positions = [*range(12), *range(3)]
    requests = [0] * 12 + [1] * 3
    own_values = torch.stack(
        [case["value_cache"][case["block_table"][b, p // 4], p % 4] for b, p in zip(requests, positions)]
    )
    torch.testing.assert_close(out, own_values.repeat_interleave(2, dim=1), atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(tree_attention_reference(**case), out, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("impl", [tree_attention_reference, tree_attention_triton], ids=["reference", "triton"])
def test_window_wider_than_query(impl):
    """Querying only a tree's newest nodes (the earlier ones cached and masked)
    equals querying the whole tree and keeping those rows."""
    full = make_case([(5, "tree:7"), (9, "tree:4")], num_heads=4, num_kv_heads=2, seed=3)
    newest = [3, 2]  # the last 3 nodes of the first tree, the last 2 of the second
    ends = full["query_start_loc"][1:].tolist()
    rows = torch.cat([torch.arange(end - k, end) for end, k in zip(ends, newest)]).to(DEVICE)
    expected = tree_attention_reference(**full)[rows]
    partial = dict(full, query=full["query"][rows], query_mask=full["query_mask"][rows],
                   query_start_loc=torch.tensor([0, *newest], device=DEVICE).cumsum(0).int(),
                   window_lens=full["query_start_loc"].diff())
    torch.testing.assert_close(impl(**partial), expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_graph_safe_launch_cuts_each_requests_keys_on_the_device(dtype, num_splits):
    """The launch a CUDA graph replays: a grid fixed by the rows a
    request and the slice count, each request's slices cut in the kernel from
    its own length; more slices than a short request has tiles leave empty
    slices, which the merge weighs 0. A padding request (no rows, no keys)
    changes nothing."""
    case = make_case(LONG + [(2, "tree:3")], num_heads=8, num_kv_heads=2, head_dim=64, block_size=32, dtype=dtype,
                     seed=7)
    expected = tree_attention_reference(**case)
    padded = dict(case, query_start_loc=torch.cat([case["query_start_loc"], case["query_start_loc"][-1:]]),
                  seq_lens=torch.cat([case["seq_lens"], case["seq_lens"].new_zeros(1)]),
                  block_table=torch.cat([case["block_table"], case["block_table"][-1:]]))
    # A graph captured for 20 rows a request, replayed on at most 9.
    out = tree_attention_triton(**padded, max_query_len=20, num_splits=num_splits, splits_on_device=True, block_n=16)
    torch.testing.assert_close(out, expected, **TOLERANCE[dtype])


def test_graph_safe_launch_needs_a_fixed_slice_count():
    case = make_case(RAGGED)
    with pytest.raises(ValueError, match="num_splits"):
        tree_attention_triton(**case, max_query_len=13, splits_on_device=True)
