"""Tree attention on vLLM's CPU backend.

The CPU platform always picks ``CPU_ATTN``; the worker re-registers that name
to :class:`TreeCPUAttentionBackend` when adaptive_tree is selected, so target
(and draft) layers get :class:`TreeCPUAttentionImpl`. vLLM's C++ kernel takes
no mask: the rows of requests whose tree branches are recomputed
(:class:`~vllm_adaptive_spec.adapter.tree_impl.TreeImplMixin`), the target's
and a model drafter's tree passes alike, by the native op of
``kernels.tree_attention_cpu``, which reads the cache pages where they lie.
Where that op is not built (no compiler, or the setting asks for torch) or
does not cover the layer's shape, the torch path: :func:`paged_tree_attention`
(``kernels.tree_attention``'s reference semantics, reading whole cache pages)
and, for a model drafter's tree layers,
:func:`~vllm_adaptive_spec.adapter.draft_attention_cpu.draft_pass_attention`,
which reads each drafting step's committed context once.

Decision: the builder pins the ``vec``/``vec16`` cache layout (K stored
transposed per block page, V row-major), the one the reader understands; on
AMX machines that replaces the ``amx`` packing for bf16.
"""

from __future__ import annotations

import functools
import itertools
import logging
from dataclasses import dataclass

import torch
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kernels.tree_attention import causal_query_mask, key_visibility
from kernels.tree_attention_cpu import NativeRows, native_op, supports, tree_attention_cpu
from vllm_adaptive_spec.adapter.cpu_cache_layout import group_keys, groups_by_length, page_layouts
from vllm_adaptive_spec.adapter.draft_attention_cpu import draft_pass_attention
from vllm_adaptive_spec.adapter.tree_impl import TreeImplMixin

PINNED_LAYOUTS = ("vec", "vec16")
# The most rows of one request in a pass the native op computes whole. Decision: a pass with a longer
# query (a prompt chunk) keeps vLLM's kernel, which skips a causal query's masked keys where the op
# reads them all, and the op then takes the tree rows alone.
WHOLE_PASS_ROWS = 64
logger = logging.getLogger(__name__)


@dataclass
class PageGroup:
    """Requests the attention reads together, padded to their longest: their
    query ``rows`` among the pass's (None: all of them, in order), the cache
    ``blocks`` each reads (``[g * nb]``), each row's slot in the ``[g * L]``
    padded query rows (``slots``; None when every slot is a row), and the
    ``[g, L, S]`` float bias of the keys (0 where visible: all context, and
    the ``query_mask`` bits of the request's last ``window`` keys; ``-inf``
    elsewhere), ``S`` the group's longest request's keys (the pages' padding
    beyond it is not read)."""

    rows: torch.Tensor | None
    blocks: torch.Tensor
    slots: torch.Tensor | None
    bias: torch.Tensor


@dataclass
class PagePlan:
    """What every layer of one pass shares: its groups of requests and
    ``buffers``, the gathered pages and float32 K and V layouts, as flat
    tensors sized for the largest group, allocated by the pass's first layer
    and refilled by every group of every layer.

    Decision: requests go into groups of similar length (sorted by keys, each
    group's padded keys at most ``plan_pages``'s ``max_keys``) rather than one
    batch padded to the longest request, which holds ``B * S_max`` keys: 30
    requests of 300-700 keys beside one of 2,000 (3.7 times the keys they
    hold) took 270 MB and 85 ms a layer on the demo model (2 threads), and a
    server's allocator keeps such a step's pages as its high-water mark.

    Decision: reused buffers, since a fresh allocation of that size in every
    layer may be served by the C allocator from new pages, whose faults then
    cost more than the reading (``benchmarks/cpu_tree_attention.py``, batch
    16, context 400, 6 rows: 13.7 and 21.5 ms a layer in two runs without,
    against 3.9-4.2 for vLLM's kernel)."""

    groups: list[PageGroup]
    buffers: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def layouts(self, kv_cache: torch.Tensor, group: PageGroup) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The group's ``[g * nb, H, bs, 2 * D]`` pages (the cache's dtype) and
        float32 ``[g, H, D, nb, bs]`` keys and ``[g, H, nb, bs, D]`` values,
        views of the plan's buffers."""
        _, heads, block_size, two_d = kv_cache.shape
        if self.buffers is None:
            pages = max(g.blocks.numel() for g in self.groups) * heads * block_size * two_d
            self.buffers = (kv_cache.new_empty(pages), torch.empty(pages // 2), torch.empty(pages // 2))
        batch, num_blocks = group.bias.shape[0], group.blocks.numel() // group.bias.shape[0]
        size = batch * num_blocks * heads * block_size * two_d
        pages, keys, values = self.buffers
        return (pages[:size].view(batch * num_blocks, heads, block_size, two_d),
                keys[: size // 2].view(batch, heads, two_d // 2, num_blocks, block_size),
                values[: size // 2].view(batch, heads, num_blocks, block_size, two_d // 2))


def plan_pages(block_table, query_start_loc, seq_lens, query_mask, block_size, window_lens=None,
               max_keys: int | None = None) -> PagePlan:
    """The pass's plan: its requests in groups of at most ``max_keys`` padded
    keys (one group when None)."""
    lengths = seq_lens.tolist()
    members = groups_by_length(lengths, block_size, max_keys) if max_keys else []
    if len(members) < 2:
        members = [list(range(len(lengths)))]
    starts = query_start_loc.tolist()
    groups = []
    for requests in members:
        if requests == list(range(len(lengths))):
            groups.append(_plan_group(None, block_table, query_start_loc, seq_lens, query_mask, block_size,
                                      window_lens))
            continue
        index = torch.tensor(requests)
        q_lens = [starts[r + 1] - starts[r] for r in requests]
        rows = torch.cat([torch.arange(starts[r], starts[r + 1]) for r in requests])
        group_starts = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=query_start_loc.dtype)
        groups.append(_plan_group(rows, block_table[index], group_starts, seq_lens[index], query_mask[rows],
                                  block_size, None if window_lens is None else window_lens[index]))
    return PagePlan(groups)


def _plan_group(rows, block_table, query_start_loc, seq_lens, query_mask, block_size, window_lens) -> PageGroup:
    keys = int(seq_lens.max())
    num_blocks = -(-keys // block_size)
    request, local, visible = key_visibility(query_start_loc, seq_lens, query_mask, keys, window_lens)
    batch, max_q, _ = visible.shape
    slots = request * max_q + local
    bias = torch.zeros(visible.shape).masked_fill_(~visible, float("-inf"))
    return PageGroup(rows, block_table[:, :num_blocks].flatten().long(),
                     None if slots.shape[0] == batch * max_q else slots, bias)


def paged_tree_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: PagePlan, scale: float) -> torch.Tensor:
    """``kernels.tree_attention`` over a CPU_ATTN cache, reading whole pages,
    one group of requests at a time (:class:`PagePlan`)."""
    if len(plan.groups) == 1 and plan.groups[0].rows is None:
        return _group_attention(query, kv_cache, plan, plan.groups[0], scale)
    out = torch.empty_like(query)
    for group in plan.groups:
        out[group.rows] = _group_attention(query[group.rows], kv_cache, plan, group, scale)
    return out


def _group_attention(query: torch.Tensor, kv_cache: torch.Tensor, plan: PagePlan, group: PageGroup,
                     scale: float) -> torch.Tensor:
    """One group's rows.

    Each (block, KV head) page holds K as ``[D, block_size]`` then V as
    ``[block_size, D]``: one ``index_select`` copies the requests' pages, K
    and V are laid out per (request, KV head) as ``[D, S]`` and ``[S, D]``,
    and two batched matrix products in float32 take the query heads of a KV
    group and the request's rows together as one ``[G * L, D]`` operand.

    Decision: one bias per group and pass rather than a masked fill per layer, and
    explicit layouts (in the plan's buffers; the copy into them also casts
    a bf16 cache to float32) rather than ``einsum``, which permutes and copies
    inside: at batch 1, context 300 and 8 rows this takes 0.34 ms a layer on
    the 2-core CPU against 0.71 for ``einsum`` with a masked fill per layer,
    the shape that matters, since only requests whose tree branches come
    here. The keys stop at the longest request's (the last page's padding is
    not multiplied)."""
    batch, max_q, span = group.bias.shape
    _, heads, block_size, two_d = kv_cache.shape
    head_dim = two_d // 2
    num_heads = query.shape[1]
    group_size = num_heads // heads
    pages, keys, values = plan.layouts(kv_cache, group)
    num_blocks = keys.shape[3]
    paged = num_blocks * block_size
    torch.index_select(kv_cache, 0, group.blocks, out=pages)
    page_keys, page_values = page_layouts(pages, batch, num_blocks)
    keys = keys.copy_(page_keys).view(batch, heads, head_dim, paged)[..., :span]
    values = values.copy_(page_values).view(batch, heads, paged, head_dim)[:, :, :span]
    rows = query.float()
    if group.slots is not None:
        rows = rows.new_zeros(batch * max_q, num_heads, head_dim).index_copy_(0, group.slots, rows)
    rows = rows.view(batch, max_q, heads, group_size, head_dim).permute(0, 2, 3, 1, 4)
    rows = rows.reshape(batch, heads, -1, head_dim)
    scores = torch.matmul(rows, keys)
    scores.view(batch, heads, group_size, max_q, span).mul_(scale).add_(group.bias[:, None, None])
    out = torch.matmul(scores.softmax(-1), values)
    out = out.view(batch, heads, group_size, max_q, head_dim).permute(0, 3, 1, 2, 4)
    out = out.reshape(batch * max_q, -1, head_dim)
    if group.slots is not None:
        out = out.index_select(0, group.slots)
    return out.reshape(query.shape).to(query.dtype)


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in PINNED_LAYOUTS:
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)


@functools.cache
def _unsupported(shape: str) -> None:
    logger.warning("adaptive_tree: the native CPU tree attention does not cover %s; its rows take the torch path",
                   shape)


class TreeCPUAttentionImpl(TreeImplMixin, CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.native_op = native_op()  # built (or found cached) as the engine starts, not in its first step

    def layer_op(self, query, kv_cache):
        """The native op where it is built and covers this layer, else None (the torch path)."""
        if self.native_op is None:
            return None
        if not supports(query, kv_cache):
            _unsupported(f"{query.dtype} queries over a {kv_cache.dtype} cache of shape {tuple(kv_cache.shape)}")
            return None
        return self.native_op

    def pass_forward(self, query, kv_cache, attn_metadata, rows):
        """A verification pass's every row on the native op (no row computed
        twice), where no request of it has more than ``WHOLE_PASS_ROWS`` rows
        (a drafting pass, whose rows see a window, is all tree rows already)."""
        if (rows.window_lens is not None or attn_metadata.causal is not True
                or attn_metadata.max_query_len > WHOLE_PASS_ROWS):
            return None
        op = self.layer_op(query, kv_cache)
        if op is None:
            return None
        if rows.page_plan is None:  # the pass's first layer lays out the metadata, the others reuse it
            rows.page_plan = whole_pass_rows(attn_metadata, rows)
        num_rows = attn_metadata.num_actual_tokens
        return tree_attention_cpu(op, query[:num_rows], kv_cache, rows.page_plan, self.scale)

    def tree_forward(self, query, kv_cache, attn_metadata, rows):
        op = self.layer_op(query, kv_cache)
        if op is not None:
            return self.native_forward(op, query, kv_cache, attn_metadata, rows)
        if getattr(rows, "step_keys", None) is not None:  # a drafting pass: the step's context read once
            return draft_pass_attention(query, kv_cache, rows, self.scale)
        if rows.page_plan is None:  # the pass's first layer builds it, the others reuse it
            rows.page_plan = plan_pages(
                attn_metadata.block_table[rows.batch_indices],
                rows.query_start_loc,
                attn_metadata.seq_lens[rows.batch_indices],
                rows.query_mask,
                kv_cache.shape[2],
                rows.window_lens,
                group_keys(kv_cache),
            )
        return paged_tree_attention(query, kv_cache, rows.page_plan, self.scale)

    def native_forward(self, op, query, kv_cache, attn_metadata, rows):
        """The native op over the pass's own metadata (a drafting pass's
        committed context is its rows' keys before their window)."""
        if rows.page_plan is None:  # the pass's first layer lays out the metadata, the others reuse it
            rows.page_plan = NativeRows.of(
                attn_metadata.block_table[rows.batch_indices],
                rows.query_start_loc,
                attn_metadata.seq_lens[rows.batch_indices],
                rows.query_mask,
                rows.window_lens,
            )
        return tree_attention_cpu(op, query, kv_cache, rows.page_plan, self.scale)


def whole_pass_rows(attn_metadata, rows) -> NativeRows:
    """Every row of a verification pass for the native op: each request's
    query rows causal, the tree rows ``rows`` seeing what their masks mark."""
    query_start_loc = attn_metadata.query_start_loc
    mask = causal_query_mask(query_start_loc, attn_metadata.max_query_len)
    width = rows.query_mask.shape[1]
    mask[rows.query_rows, :width] = rows.query_mask
    mask[rows.query_rows, width:] = False
    return NativeRows.of(attn_metadata.block_table, query_start_loc, attn_metadata.seq_lens, mask)


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
