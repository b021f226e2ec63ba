"""Where a CPU_ATTN cache keeps a key and a value, and how many keys the
tree paths read at once (:mod:`~vllm_adaptive_spec.adapter.attention_cpu`
for a pass, :mod:`~vllm_adaptive_spec.adapter.draft_attention_cpu` for a
drafting step's context)."""

from __future__ import annotations

import torch


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[num_blocks, block_size, H, D] views of K and V in a CPU_ATTN cache
    ``[num_blocks, H, block_size, 2 * D]`` written with the vec layout: within
    each (block, head) page, K is a ``[D, block_size]`` area, then V a
    ``[block_size, D]`` area."""
    num_blocks, heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    block_stride, head_stride = kv_cache.stride(0), kv_cache.stride(1)
    base = kv_cache.storage_offset()
    size = (num_blocks, block_size, heads, head_dim)
    key = kv_cache.as_strided(size, (block_stride, 1, head_stride, block_size), base)
    value = kv_cache.as_strided(size, (block_stride, head_dim, head_stride, 1), base + block_size * head_dim)
    return key, value


def page_layouts(pages: torch.Tensor, batch: int, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Gathered pages ``[batch * num_blocks, H, block_size, 2 * D]`` (each
    request's blocks in turn) as views of their keys ``[batch, H, D,
    num_blocks, block_size]`` and values ``[batch, H, num_blocks,
    block_size, D]``, the layouts the tree paths' products read once copied."""
    _, heads, block_size, two_d = pages.shape
    head_dim = two_d // 2
    flat = pages.view(batch, num_blocks, heads, block_size * two_d)
    keys = flat[..., : block_size * head_dim].view(batch, num_blocks, heads, head_dim, block_size)
    values = flat[..., block_size * head_dim:].view(batch, num_blocks, heads, block_size, head_dim)
    return keys.permute(0, 2, 3, 1, 4), values.permute(0, 2, 1, 3, 4)


GROUP_BYTES = 12 << 20


def group_keys(kv_cache: torch.Tensor) -> int:
    """The padded keys one group of requests may read at once: its pages (the
    cache's dtype) and float32 K and V layouts take ``GROUP_BYTES`` at most."""
    _, heads, block_size, two_d = kv_cache.shape
    per_key = heads * two_d * (kv_cache.element_size() + 4)
    return max(block_size, GROUP_BYTES // per_key)


def groups_by_length(lengths: list[int], block_size: int, max_keys: int) -> list[list[int]]:
    """Requests in ascending key length, cut wherever the next would take the
    group's padded keys (its size times its longest, in whole blocks) past
    ``max_keys``; a request longer than that is a group of its own."""
    order = sorted(range(len(lengths)), key=lengths.__getitem__)
    groups: list[list[int]] = []
    for request in order:
        padded = -(-lengths[request] // block_size) * block_size
        if groups and (len(groups[-1]) + 1) * padded <= max_keys:
            groups[-1].append(request)
        else:
            groups.append([request])
    return groups
