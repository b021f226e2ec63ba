"""Tree attention of a drafting step's passes on the CPU, the committed
context read once per step.

A model drafter grows a step's trees in one pass per tree layer, and every
pass's rows see their request's whole committed draft context plus some of
the step's tree nodes so far. The context does not change during the step
(nodes are written after it, at ``C + node id``), so its keys and values are
gathered from the paged cache and laid out in float32 once per step and
cache (:class:`ContextKeys`, kept in the step's :class:`~vllm_adaptive_spec.step.tree_step.StepKeys`),
and each pass gathers only the tree's window. A row's scores over both are
one softmax, so the result is :func:`~vllm_adaptive_spec.adapter.attention_cpu.paged_tree_attention`'s.

Decision: requests are grouped by context length as the pass's plan groups
them (:func:`~vllm_adaptive_spec.adapter.cpu_cache_layout.group_keys`); a
group's members without rows in a pass compute padding rows rather than
being gathered out of the group's layout, a copy the cache is meant to
avoid. One pass of 64 requests took half the time of re-reading the pages,
the EAGLE-3 tree's draft forward about 10% less at batch 64
(``benchmarks/results/history.md``, 2026-11-28).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views, group_keys, groups_by_length, page_layouts


@dataclass
class ContextGroup:
    """Step requests ``members`` [g] and their context's float32 ``keys``
    [g, H, D, S] and ``values`` [g, H, S, D], ``bias`` [g, 1, S] (0 before
    each member's context length, ``-inf`` after)."""

    members: torch.Tensor
    keys: torch.Tensor
    values: torch.Tensor
    bias: torch.Tensor


@dataclass
class ContextKeys:
    """One cache's context layouts for a drafting step; ``group_of`` and
    ``slot_of`` [n]: each step request's group and its place in it."""

    groups: list[ContextGroup]
    group_of: torch.Tensor
    slot_of: torch.Tensor


def gather_context(kv_cache: torch.Tensor, lengths: torch.Tensor, block_table: torch.Tensor) -> ContextKeys:
    """The context keys of the step's requests (``lengths`` [n], their
    block-table rows [n, nb]) out of ``kv_cache``, grouped by length."""
    _, heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    members = groups_by_length(lengths.tolist(), block_size, group_keys(kv_cache))
    group_of = torch.zeros(lengths.shape[0], dtype=torch.long)
    slot_of = torch.zeros(lengths.shape[0], dtype=torch.long)
    groups = []
    for index, requests in enumerate(members):
        member = torch.tensor(requests, dtype=torch.long)
        group_of[member], slot_of[member] = index, torch.arange(len(requests))
        span = int(lengths[member].max())
        num_blocks = -(-span // block_size)
        pages = kv_cache.index_select(0, block_table[member, :num_blocks].flatten().long())
        page_keys, page_values = page_layouts(pages, len(requests), num_blocks)
        keys = page_keys.float().reshape(len(requests), heads, head_dim, -1)[..., :span]
        values = page_values.float().reshape(len(requests), heads, -1, head_dim)[:, :, :span]
        bias = torch.where(torch.arange(span) < lengths[member].unsqueeze(1), 0.0, float("-inf")).unsqueeze(1)
        groups.append(ContextGroup(member, keys.contiguous(), values.contiguous(), bias))
    return ContextKeys(groups, group_of, slot_of)


def draft_pass_attention(query: torch.Tensor, kv_cache: torch.Tensor, rows, scale: float) -> torch.Tensor:
    """``[T, Hq, D]`` attention of one drafting pass's rows (a
    :class:`~vllm_adaptive_spec.step.tree_step.DraftStep` with ``step_keys``):
    the step's context keys (gathered by the step's first pass over this
    cache) and the pass's window of tree nodes, group by group."""
    step = rows.step_keys
    context = step.cache.get(kv_cache.data_ptr())
    if context is None:
        context = step.cache[kv_cache.data_ptr()] = gather_context(kv_cache, step.lengths, step.block_table)
    q_lens = rows.query_start_loc.diff().long()
    request = torch.repeat_interleave(torch.arange(q_lens.shape[0]), q_lens)
    step_request = rows.step_requests[request]
    local = torch.arange(query.shape[0]) - rows.query_start_loc[:-1].long()[request]
    group_of = context.group_of[step_request]
    out = torch.empty_like(query)
    for index, group in enumerate(context.groups):
        mine = (group_of == index).nonzero(as_tuple=True)[0]
        if mine.numel():
            slots = context.slot_of[step_request[mine]] * rows.max_query_len + local[mine]
            window = _window(kv_cache, step.lengths[group.members], step.block_table[group.members],
                             rows.query_mask.shape[1])
            out[mine] = _group_rows(query[mine], slots, rows.query_mask[mine], group, window, rows.max_query_len,
                                    scale)
    return out


def _window(kv_cache: torch.Tensor, lengths: torch.Tensor, block_table: torch.Tensor, width: int):
    """The ``width`` keys after each member's context (its tree's nodes so
    far, as this pass left the cache): float32 ``[g, H, D, W]`` keys and
    ``[g, H, W, D]`` values."""
    key_view, value_view = cache_views(kv_cache)
    block_size = key_view.shape[1]
    positions = lengths.unsqueeze(1) + torch.arange(width)
    column = (positions // block_size).clamp(max=block_table.shape[1] - 1)
    blocks, offsets = block_table.gather(1, column).long(), positions % block_size
    keys = key_view[blocks, offsets].float().permute(0, 2, 3, 1)
    values = value_view[blocks, offsets].float().permute(0, 2, 1, 3)
    return keys, values


def _group_rows(query, slots, mask, group: ContextGroup, window, max_q: int, scale: float) -> torch.Tensor:
    """One group's rows of a pass (at ``slots`` of the group's ``[g * L]``
    padded rows; members without rows compute padding): scores over the
    group's context and over each member's ``window`` where the rows'
    ``mask`` bits mark it, one softmax."""
    size, heads, head_dim, span = group.keys.shape
    num_heads = query.shape[1]
    group_size = num_heads // heads
    window_keys, window_values = window
    visible = torch.zeros(size * max_q, mask.shape[1], dtype=torch.bool).index_copy_(0, slots, mask)
    window_bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf")).view(size, 1, 1, max_q, -1)
    padded = query.new_zeros(size * max_q, num_heads, head_dim).float().index_copy_(0, slots, query.float())
    padded = padded.view(size, max_q, heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
    padded = padded.reshape(size, heads, group_size * max_q, head_dim)
    scores = torch.cat([
        torch.matmul(padded, group.keys).view(size, heads, group_size, max_q, span).mul_(scale)
        .add_(group.bias[:, None, None]),
        torch.matmul(padded, window_keys).view(size, heads, group_size, max_q, -1).mul_(scale).add_(window_bias),
    ], dim=-1).softmax(-1).view(size, heads, group_size * max_q, -1)
    out = (torch.matmul(scores[..., :span], group.values)
           + torch.matmul(scores[..., span:], window_values))
    out = out.view(size, heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4).reshape(size * max_q, -1, head_dim)
    return out.index_select(0, slots).to(query.dtype)
