"""Tree attention: the Triton kernel (interpreted off GPU) against the torch
reference, and the reference against a dense computation."""

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

    return dict(
        query=torch.randn(sum(q_lens), num_heads, head_dim, generator=gen).to(dtype),
        key_cache=caches[0],
        value_cache=caches[1],
        block_table=block_table,
        query_start_loc=torch.tensor([0, *q_lens], dtype=torch.int32).cumsum(0).int(),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_mask=torch.cat(rows),
        scale=head_dim**-0.5,
    )


# With blocks of 4: context 5 (mid-block) with a tree ending on a block boundary,
# context 8 (ends on a boundary) with one token, a causal prefill of 13 without
# context, context 11 with a tree, and another lone decode token.
RAGGED = [(5, "tree:7"), (8, 1), (0, 13), (11, "tree:5"), (3, 1)]


@pytest.mark.parametrize(
    "config",
    [
        dict(),
        dict(num_heads=4, num_kv_heads=2),
        dict(num_heads=4, num_kv_heads=2, transposed=(True, False), head_dim=24),
        dict(num_heads=4, num_kv_heads=1, block_size=16, seed=1),
    ],
    ids=["mha", "gqa", "gqa-key-transposed-d24", "mqa-block16"],
)
def test_triton_matches_reference_float32(config):
    case = make_case(RAGGED, **config)
    expected = tree_attention_reference(**case)
    for block_n in (8, 32):
        torch.testing.assert_close(tree_attention_triton(**case, block_n=block_n), expected, atol=1e-5, rtol=1e-5)


def test_triton_matches_reference_bfloat16():
    case = make_case(RAGGED, num_heads=4, num_kv_heads=2, transposed=(True, True), dtype=torch.bfloat16)
    out = tree_attention_triton(**case, block_n=16)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out, tree_attention_reference(**case), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("seed", range(3))
def test_random_trees(seed):
    case = make_case([(6, "tree:9"), (4, "tree:12"), (9, "tree:3")], seed=seed, block_size=8)
    torch.testing.assert_close(tree_attention_triton(**case, block_n=16), tree_attention_reference(**case), atol=1e-5, rtol=1e-5)


def test_tree_mask_matters():
    case = make_case([(6, "tree:9"), (4, "tree:12")], seed=3)
    all_visible = dict(case, query_mask=torch.ones_like(case["query_mask"]))
    tree_out = tree_attention_triton(**case, block_n=16)
    assert not torch.allclose(tree_out, tree_attention_reference(**all_visible), atol=1e-3)
    assert not torch.allclose(tree_out, tree_attention_triton(**all_visible, block_n=16), atol=1e-3)


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


def test_dispatch_uses_reference_on_cpu():
    case = make_case([(3, "tree:4")])
    assert torch.equal(tree_attention(**case), tree_attention_reference(**case))


def test_rows_seeing_only_themselves():
    """Each row attends to its own key alone, so it returns that key's value; a
    row's first tiles are then fully masked."""
    case = make_case([(0, "tree:12"), (0, 3)], num_heads=4, num_kv_heads=2, block_size=4, seed=4)
    case["query_mask"] = torch.eye(12, dtype=torch.bool)[[*range(12), *range(3)]]
    out = tree_attention_triton(**case, block_n=8)
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
    rows = torch.cat([torch.arange(end - k, end) for end, k in zip(ends, newest)])
    expected = tree_attention_reference(**full)[rows]
    partial = dict(full, query=full["query"][rows], query_mask=full["query_mask"][rows],
                   query_start_loc=torch.tensor([0, *newest]).cumsum(0).int(),
                   window_lens=full["query_start_loc"].diff())
    torch.testing.assert_close(impl(**partial), expected, atol=1e-5, rtol=1e-5)
