"""Tree attention on vLLM's CPU backend.

The CPU platform always picks ``CPU_ATTN``; the worker re-registers that name
to :class:`TreeCPUAttentionBackend` when adaptive_tree is selected, so target
(and draft) layers get :class:`TreeCPUAttentionImpl`. Its C++ kernel takes no
mask: the rows of requests whose tree branches are recomputed
(:class:`~vllm_adaptive_spec.adapter.tree_impl.TreeImplMixin`) by
:func:`paged_tree_attention` (``kernels.tree_attention``'s reference
semantics, reading whole cache pages).

Decision: the builder pins the ``vec``/``vec16`` cache layout (K stored
transposed per block page, V row-major), the one the reader understands; on
AMX machines that replaces the ``amx`` packing for bf16.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kernels.tree_attention import key_visibility
from vllm_adaptive_spec.adapter.tree_impl import TreeImplMixin

PINNED_LAYOUTS = ("vec", "vec16")


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


@dataclass
class PagePlan:
    """What every layer of one pass shares: the cache blocks each request
    reads, each query row's slot in the ``[B * L]`` padded query rows
    (``slots``; None when every slot is a row), and the ``[B, L, S]`` float
    bias of the keys (0 where visible: all context, and the ``query_mask``
    bits of the request's last ``window`` keys; ``-inf`` elsewhere), ``S``
    the longest request's keys (the pages' padding beyond it is not read).
    ``buffers``: the pass's gathered pages and float32 K and V layouts,
    allocated by its first layer and refilled by the others.

    Decision: reused buffers, since a fresh allocation of that size in every
    layer may be served by the C allocator from new pages, whose faults then
    cost more than the reading (``benchmarks/cpu_tree_attention.py``, batch
    16, context 400, 6 rows: 13.7 and 21.5 ms a layer in two runs without,
    against 3.9-4.2 for vLLM's kernel)."""

    blocks: torch.Tensor
    slots: torch.Tensor | None
    bias: torch.Tensor
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def layouts(self, kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The pass's ``[B * nb, H, bs, 2 * D]`` pages (the cache's dtype) and
        float32 ``[B, H, D, nb, bs]`` keys and ``[B, H, nb, bs, D]`` values."""
        if self.buffers is None:
            _, heads, block_size, two_d = kv_cache.shape
            batch = self.bias.shape[0]
            num_blocks = self.blocks.numel() // batch
            self.buffers = (
                kv_cache.new_empty(batch * num_blocks, heads, block_size, two_d),
                torch.empty(batch, heads, two_d // 2, num_blocks, block_size),
                torch.empty(batch, heads, num_blocks, block_size, two_d // 2),
            )
        return self.buffers


def plan_pages(block_table, query_start_loc, seq_lens, query_mask, block_size, window_lens=None) -> PagePlan:
    keys = int(seq_lens.max())
    num_blocks = -(-keys // block_size)
    request, local, visible = key_visibility(query_start_loc, seq_lens, query_mask, keys, window_lens)
    batch, max_q, _ = visible.shape
    slots = request * max_q + local
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return PagePlan(block_table[:, :num_blocks].flatten().long(), None if slots.shape[0] == batch * max_q else slots, bias)


def paged_tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: PagePlan, scale: float) -> torch.Tensor:
    """``kernels.tree_attention`` over a CPU_ATTN cache, reading whole pages.

    Each (block, KV head) page holds K as ``[D, block_size]`` then V as
    ``[block_size, D]``: one ``index_select`` copies the requests' pages, K
    and V are laid out per (request, KV head) as ``[D, S]`` and ``[S, D]``,
    and two batched matrix products in float32 take the query heads of a KV
    group and the request's rows together as one ``[G * L, D]`` operand.

    Decision: one bias per pass rather than a masked fill per layer, and
    explicit layouts (in the plan's buffers; the copy into them also casts
    a bf16 cache to float32) rather than ``einsum``, which permutes and copies
    inside: at batch 1, context 300 and 8 rows this takes 0.34 ms a layer on
    the 2-core CPU against 0.71 for ``einsum`` with a masked fill per layer,
    the shape that matters, since only requests whose tree branches come
    here. The keys stop at the longest request's (the last page's padding is
    not multiplied)."""
    batch, max_q, span = plan.bias.shape
    _, heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    group = query.shape[1] // heads
    pages, keys, values = plan.layouts(kv_cache)
    num_blocks = keys.shape[3]
    paged = num_blocks * block_size
    torch.index_select(kv_cache, 0, plan.blocks, out=pages)
    pages = pages.view(batch, num_blocks, heads, 2 * block_size * head_dim)
    page_keys = pages[..., : block_size * head_dim].view(batch, num_blocks, heads, head_dim, block_size)
    keys = keys.copy_(page_keys.permute(0, 2, 3, 1, 4)).view(batch, heads, head_dim, paged)[..., :span]
    page_values = pages[..., block_size * head_dim:].view(batch, num_blocks, heads, block_size, head_dim)
    values = values.copy_(page_values.permute(0, 2, 1, 3, 4)).view(batch, heads, paged, head_dim)[:, :, :span]
    rows = query.float()
    if plan.slots is not None:
        rows = rows.new_zeros(batch * max_q, heads * group, head_dim).index_copy_(0, plan.slots, rows)
    rows = rows.view(batch, max_q, heads, group, head_dim).permute(0, 2, 3, 1, 4).reshape(batch, heads, -1, head_dim)
    scores = torch.matmul(rows, keys)
    scores.view(batch, heads, group, max_q, span).mul_(scale).add_(plan.bias[:, None, None])
    out = torch.matmul(scores.softmax(-1), values)
    out = out.view(batch, heads, group, max_q, head_dim).permute(0, 3, 1, 2, 4).reshape(batch * max_q, -1, head_dim)
    if plan.slots is not None:
        out = out.index_select(0, plan.slots)
    return out.reshape(query.shape).to(query.dtype)


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in PINNED_LAYOUTS:
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)


class TreeCPUAttentionImpl(TreeImplMixin, CPUAttentionBackendImpl):
    def tree_forward(self, query, kv_cache, attn_metadata, rows):
        if rows.page_plan is None:  # the pass's first layer builds it, the others reuse it
            rows.page_plan = plan_pages(
                attn_metadata.block_table[rows.batch_indices],
                rows.query_start_loc,
                attn_metadata.seq_lens[rows.batch_indices],
                rows.query_mask,
                kv_cache.shape[2],
                rows.window_lens,
            )
        return paged_tree_attention(query, kv_cache, rows.page_plan, self.scale)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
