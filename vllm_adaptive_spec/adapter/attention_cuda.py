"""Tree attention inside vLLM's CUDA attention backends, ``FLASH_ATTN`` (the
default on Hopper) and ``TRITON_ATTN``.

The CUDA worker re-registers both names to the subclasses below before any
attention layer exists, so every target and draft layer that vLLM gives one
of these backends gets a tree-aware impl: rows without a branching tree run
the stock kernel untouched (FlashAttention 3 or vLLM's unified Triton
kernel); the rows of requests whose tree branches are recomputed
(:class:`~vllm_adaptive_spec.adapter.tree_impl.TreeImplMixin`) by
``kernels.tree_attention``'s Triton kernel over the same paged cache. A model
whose layers vLLM gives any other backend is refused when it loads
(:func:`~vllm_adaptive_spec.adapter.tree_impl.check_tree_backends`).

Both backends keep a layer's KV as the logical ``[num_blocks, H, block_size,
2 * D]`` tensor and split each token's content into K then V
(``kv_cache.transpose(1, 2).split(head_size, -1)`` in both impls), whatever
the physical stride order; :func:`cache_views` takes the same views, and the
kernels read them through their strides. ``tests/test_cuda_attention.py``
pins this against each backend's own cache writer.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backends.flash_attn import FlashAttentionBackend, FlashAttentionImpl
from vllm.v1.attention.backends.triton_attn import TritonAttentionBackend, TritonAttentionImpl

from kernels.tree_attention import graph_splits, tree_attention, tree_attention_triton
from vllm_adaptive_spec.adapter.tree_impl import TreeImplMixin, register_tree_backend


def cache_views(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``[num_blocks, block_size, H, D]`` views of K and V in a FLASH_ATTN /
    TRITON_ATTN layer cache ``[num_blocks, H, block_size, 2 * D]``."""
    key, value = kv_cache.transpose(1, 2).split(kv_cache.shape[-1] // 2, dim=-1)
    return key, value


class _CudaTreeImpl(TreeImplMixin):
    def tree_forward(self, query, kv_cache, attn_metadata, rows):
        key_cache, value_cache = cache_views(kv_cache)
        return tree_attention(
            query,
            key_cache,
            value_cache,
            attn_metadata.block_table[rows.batch_indices],
            rows.query_start_loc,
            attn_metadata.seq_lens[rows.batch_indices],
            rows.query_mask,
            self.scale,
            rows.window_lens,
            max_query_len=rows.max_query_len,
            max_seq_len=attn_metadata.max_seq_len,
        )


    def uniform_forward(self, query, kv_cache, attn_metadata, rows):
        key_cache, value_cache = cache_views(kv_cache)
        num_reqs = attn_metadata.seq_lens.shape[0]
        return tree_attention_triton(
            query,
            key_cache,
            value_cache,
            attn_metadata.block_table,
            attn_metadata.query_start_loc,
            attn_metadata.seq_lens,
            rows.mask[: query.shape[0], : rows.rows],
            self.scale,
            max_query_len=rows.rows,
            num_splits=graph_splits(num_reqs, rows.rows, self.num_heads, key_cache.shape[2], query.device),
            splits_on_device=True,
        )


class TreeFlashAttentionImpl(_CudaTreeImpl, FlashAttentionImpl):
    pass


class TreeTritonAttentionImpl(_CudaTreeImpl, TritonAttentionImpl):
    pass


class TreeFlashAttentionBackend(FlashAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeFlashAttentionImpl


class TreeTritonAttentionBackend(TritonAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeTritonAttentionImpl


def register_tree_backends() -> None:
    """Point ``FLASH_ATTN`` and ``TRITON_ATTN`` at the tree-aware backends in
    this process (before the model's layers are built)."""
    register_tree_backend("FLASH_ATTN", f"{__name__}.TreeFlashAttentionBackend")
    register_tree_backend("TRITON_ATTN", f"{__name__}.TreeTritonAttentionBackend")
