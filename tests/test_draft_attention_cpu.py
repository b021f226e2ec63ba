"""A drafting step's passes on the CPU read the committed context once
(``adapter/draft_attention_cpu.py``) and give ``kernels.tree_attention``'s
reference results: passes over changing subsets of the step's requests,
windows that grow as tree nodes are written after the context, requests in
groups of several lengths, GQA, float32 and bfloat16."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_attention import tree_attention_reference
from vllm_adaptive_spec.adapter import cpu_cache_layout
from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views
from vllm_adaptive_spec.adapter.draft_attention_cpu import draft_pass_attention
from vllm_adaptive_spec.step.tree_step import DraftStep, StepKeys

HEADS, GROUP, HEAD_DIM, BLOCK = 3, 3, 64, 32


def _pass(rng, subset, window, lengths, block_table, kv_cache):
    """One tree layer's pass over the step requests ``subset``: 1-3 rows
    each (the newest nodes of its ``window``), each seeing itself and a
    random set of the window's earlier nodes; its inputs and the reference."""
    q_lens = [min(int(torch.randint(1, 4, (1,), generator=rng)), int(window[r])) for r in subset]
    width = int(window[subset].max())
    masks = []
    for r, q in zip(subset.tolist(), q_lens):
        bits = torch.rand(q, width, generator=rng) < 0.5
        bits[:, int(window[r]):] = False
        bits[torch.arange(q), int(window[r]) - q + torch.arange(q)] = True
        masks.append(bits)
    query_mask = torch.cat(masks)
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    query = torch.randn(sum(q_lens), HEADS * GROUP, HEAD_DIM, generator=rng).to(kv_cache.dtype)
    seq_lens = (lengths[subset] + window[subset]).to(torch.int32)
    key_view, value_view = cache_views(kv_cache)
    expected = tree_attention_reference(query, key_view, value_view, block_table[subset], starts, seq_lens,
                                        query_mask, 0.125, window[subset].to(torch.int32))
    rows = DraftStep(batch_indices=torch.arange(len(subset)), query_rows=torch.arange(query.shape[0]),
                     query_start_loc=starts, query_mask=query_mask, window_lens=window[subset].to(torch.int32),
                     max_query_len=max(q_lens), step_requests=subset)
    return query, rows, expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(3))
def test_every_pass_of_a_step_matches_the_reference(seed, dtype, monkeypatch):
    monkeypatch.setattr(cpu_cache_layout, "GROUP_BYTES", 3 * BLOCK * HEADS * 2 * HEAD_DIM * 8)  # 3 blocks a group
    rng = torch.Generator().manual_seed(seed)
    requests, layers = 7, 4
    lengths = torch.randint(5, 150, (requests,), generator=rng)
    blocks_per = -(-(int(lengths.max()) + 3 * layers) // BLOCK)
    num_blocks = requests * blocks_per + 3
    block_table = torch.randperm(num_blocks, generator=rng)[: requests * blocks_per].view(requests, blocks_per)
    kv_cache = torch.randn(num_blocks, HEADS, BLOCK, 2 * HEAD_DIM, generator=rng).to(dtype)
    step = StepKeys(lengths, block_table.to(torch.int32))
    window = torch.zeros(requests, dtype=torch.long)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    for layer in range(layers):
        subset = torch.randperm(requests, generator=rng)[: int(torch.randint(2, requests + 1, (1,), generator=rng))]
        subset = subset.sort().values if layer % 2 else subset  # in and out of the step's order
        window[subset] += 3
        key_view, value_view = cache_views(kv_cache)  # this layer's nodes written after each context
        for r in subset.tolist():
            positions = int(lengths[r]) + torch.arange(int(window[r]) - 3, int(window[r]))
            blocks, offsets = block_table[r, positions // BLOCK], positions % BLOCK
            key_view[blocks, offsets] = torch.randn(3, HEADS, HEAD_DIM, generator=rng).to(dtype)
            value_view[blocks, offsets] = torch.randn(3, HEADS, HEAD_DIM, generator=rng).to(dtype)
        query, rows, expected = _pass(rng, subset, window, lengths, block_table, kv_cache)
        rows.step_keys = step
        got = draft_pass_attention(query, kv_cache, rows, 0.125)
        torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)
    (context,) = step.cache.values()  # gathered once for the step, in several groups
    assert len(context.groups) > 1
    assert sorted(torch.cat([g.members for g in context.groups]).tolist()) == list(range(requests))
