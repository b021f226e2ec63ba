"""The CPU tree path's page reader gives ``kernels.tree_attention``'s reference
results on vLLM's CPU cache layout: random trees, ragged requests, GQA,
windows wider than the query (tree drafting), float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_attention import tree_attention_reference
from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch


def _random_tree(rng: torch.Generator, size: int) -> DraftTree:
    parents = [-1] + [int(torch.randint(-1, i, (1,), generator=rng)) for i in range(1, size)]
    depth = []
    for parent in parents:
        depth.append(0 if parent == -1 else depth[parent] + 1)
    order = sorted(range(size), key=lambda i: (depth[i], i))  # breadth-first
    index = {old: new for new, old in enumerate(order)}
    return DraftTree(list(range(size)), [-1 if parents[i] == -1 else index[parents[i]] for i in order], [1.0] * size)


def _case(seed: int, dtype, window: bool, requests: int = 3):
    from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views

    rng = torch.Generator().manual_seed(seed)
    heads, group, head_dim, block_size = 3, 3, 64, 32
    sizes = [int(torch.randint(1, 9, (1,), generator=rng)) for _ in range(requests)]
    trees = [_random_tree(rng, n) for n in sizes]
    rows_mask = TreeBatch.from_trees(trees).row_mask()
    contexts = [int(torch.randint(1, 90, (1,), generator=rng)) for _ in trees]
    q_lens = [1 + n for n in sizes]
    if window:  # query only the deepest node of each tree; the window covers root and nodes
        q_lens = [1] * len(trees)
    masks = []
    for k, n in enumerate(sizes):
        full = rows_mask[k, : 1 + n, : 1 + n]
        masks.append(full[-1:] if window else full)
    width = max(m.shape[1] for m in masks)
    query_mask = torch.cat([torch.nn.functional.pad(m, (0, width - m.shape[1])) for m in masks])
    seq_lens = torch.tensor([c + 1 + n for c, n in zip(contexts, sizes)], dtype=torch.int32)
    blocks_per = -(-int(seq_lens.max()) // block_size)
    num_blocks = len(trees) * blocks_per + 2
    block_table = torch.randperm(num_blocks, generator=rng)[: len(trees) * blocks_per].view(len(trees), blocks_per)
    kv_cache = torch.randn(num_blocks, heads, block_size, 2 * head_dim, generator=rng).to(dtype)
    query = torch.randn(sum(q_lens), heads * group, head_dim, generator=rng).to(dtype)
    query_start_loc = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    window_lens = torch.tensor([1 + n for n in sizes], dtype=torch.int32) if window else None
    key_view, value_view = cache_views(kv_cache)
    expected = tree_attention_reference(
        query, key_view, value_view, block_table, query_start_loc, seq_lens, query_mask, 0.125, window_lens
    )
    return query, kv_cache, block_table, query_start_loc, seq_lens, query_mask, window_lens, expected


# (requests, padded keys per group): 1 request, every padded query slot a row (no scatter); 3 in one
# group; 6 in groups of one to four requests (128 keys: four blocks), read in another order than given.
@pytest.mark.parametrize("requests,max_keys", [(1, None), (3, None), (6, 128)])
@pytest.mark.parametrize("window", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_page_reader_matches_the_reference(seed, dtype, window, requests, max_keys):
    from vllm_adaptive_spec.adapter.attention_cpu import paged_tree_attention, plan_pages
    from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views

    query, kv_cache, block_table, starts, seq_lens, query_mask, window_lens, expected = _case(
        seed, dtype, window, requests
    )
    plan = plan_pages(block_table, starts, seq_lens, query_mask, kv_cache.shape[2], window_lens, max_keys)
    if max_keys:
        assert len(plan.groups) > 1
    got = paged_tree_attention(query, kv_cache, plan, 0.125)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    # The next layer of the pass reuses the plan (and its buffers) on its own cache.
    next_layer = kv_cache.flip(0)
    key_view, value_view = cache_views(next_layer)
    expected = tree_attention_reference(
        query, key_view, value_view, block_table, starts, seq_lens, query_mask, 0.125, window_lens
    )
    got = paged_tree_attention(query, next_layer, plan, 0.125)
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


def test_groups_bound_the_padded_keys_of_a_ragged_batch():
    """Thirty requests of 300-700 keys beside one of 2,000: each group's
    padded keys stay within the bound (the long request alone), every
    request is in one group, and the plan's buffers hold the largest group
    only, where one padded batch would hold 31 x 2,048 keys."""
    from vllm_adaptive_spec.adapter.attention_cpu import plan_pages
    from vllm_adaptive_spec.adapter.cpu_cache_layout import group_keys

    rng = torch.Generator().manual_seed(0)
    block_size, rows = 32, 5
    lengths = [int(v) for v in torch.randint(300, 700, (30,), generator=rng)] + [2000]
    blocks = -(-max(lengths) // block_size)
    block_table = torch.arange(len(lengths) * blocks, dtype=torch.int32).view(len(lengths), blocks)
    starts = torch.arange(0, len(lengths) * rows + 1, rows, dtype=torch.int32)
    mask = torch.tril(torch.ones(rows, rows, dtype=torch.bool)).repeat(len(lengths), 1)
    kv_cache = torch.zeros(len(lengths) * blocks, 3, block_size, 128)
    max_keys = group_keys(kv_cache)
    assert 700 * 2 < max_keys < 2000 * 31
    plan = plan_pages(block_table, starts, torch.tensor(lengths, dtype=torch.int32), mask, block_size, None, max_keys)
    padded = [g.blocks.numel() * block_size for g in plan.groups]
    assert max(padded) <= max(max_keys, 2016) and len(plan.groups) > 1
    assert sorted(torch.cat([g.rows for g in plan.groups]).tolist()) == list(range(len(lengths) * rows))
    plan.layouts(kv_cache, plan.groups[0])
    assert plan.buffers[0].numel() == max(padded) * 3 * 128


def test_the_tree_path_and_vllms_kernel_agree_on_causal_rows(tmp_path):
    """``benchmarks/cpu_tree_attention.py`` times the paths on the same chain rows:
    the comparison only means something if they compute the same outputs."""
    import json

    from benchmarks import cpu_tree_attention

    shapes = "1x200x5,3x150x4+1500"
    cpu_tree_attention.main(["--shapes", shapes, "--calls", "2", "--repeats", "1", "--out", str(tmp_path)])
    results = json.loads((tmp_path / "cpu_tree_attention.json").read_text())["results"]
    assert [(r["batch"], r["context"], r["long"], r["rows"], r["groups"]) for r in results] == [
        (1, 200, 0, 5, 1), (4, 150, 1500, 4, 2)]
    assert all(r["max_abs_difference"] < 1e-5 and r["tree_path_ms"] > 0 and r["native_ms"] > 0 for r in results)


def test_a_whole_pass_is_its_causal_rows_and_its_tree_rows():
    """The native op's whole verification pass (``whole_pass_rows``): a
    decoding request's row, a chain's causal rows and a branching tree's rows
    together give the reference's result for each, where vLLM's kernel would
    have computed the first two and the tree path the third."""
    from types import SimpleNamespace

    from kernels.tree_attention import causal_query_mask
    from kernels.tree_attention_cpu import machine_isa, build, tree_attention_cpu
    from vllm_adaptive_spec.adapter.attention_cpu import whole_pass_rows
    from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views
    from vllm_adaptive_spec.step.tree_step import AttentionRows

    rng = torch.Generator().manual_seed(0)
    tree = torch.tensor([[1, 0, 0, 0], [1, 1, 0, 0], [1, 0, 1, 0], [1, 0, 1, 1]], dtype=torch.bool)
    q_lens, seq_lens = [1, 5, 4], torch.tensor([40, 170, 90], dtype=torch.int32)
    starts = torch.tensor([0, 1, 6, 10], dtype=torch.int32)
    kv_cache = torch.randn(20, 3, 32, 128, generator=rng)
    block_table = torch.randperm(20, generator=rng)[:18].view(3, 6).int()
    query = torch.randn(10, 9, 64, generator=rng)
    metadata = SimpleNamespace(query_start_loc=starts, max_query_len=max(q_lens), block_table=block_table,
                               seq_lens=seq_lens)
    rows = AttentionRows(batch_indices=torch.tensor([2]), query_rows=torch.arange(6, 10),
                         query_start_loc=torch.tensor([0, 4], dtype=torch.int32), query_mask=tree, max_query_len=4)
    got = tree_attention_cpu(build(machine_isa()), query, kv_cache, whole_pass_rows(metadata, rows), 0.125)
    mask = causal_query_mask(starts, 5)
    mask[6:10, :4], mask[6:10, 4:] = tree, False
    expected = tree_attention_reference(query, *cache_views(kv_cache), block_table, starts, seq_lens, mask, 0.125)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    causal = tree_attention_reference(query, *cache_views(kv_cache), block_table, starts, seq_lens,
                                      causal_query_mask(starts, 5), 0.125)
    assert not torch.allclose(got[6:], causal[6:], atol=1e-3)  # the tree's rows are not the causal ones
