"""Tree attention on vLLM's CPU backend.

The CPU platform always picks ``CPU_ATTN``; the worker re-registers that name
to :class:`TreeCPUAttentionBackend` when adaptive_tree is selected, so target
(and draft) layers get :class:`TreeCPUAttentionImpl`. Its C++ kernel takes no
mask: in a batch that mixes tree and other rows it runs as usual, then the
rows of requests that carry a tree are recomputed by ``kernels.tree_attention``
reading the paged cache directly, and overwritten. Only requests whose tree
branches take that path: a chain (most trees under the load budget) is exact
under the C++ kernel; when every row of a pass belongs to such a tree, only
the tree path runs.

Decision: the builder pins the ``vec``/``vec16`` cache layout (K stored
transposed per block page, V row-major), the one the reader understands; on
AMX machines that replaces the ``amx`` packing for bf16.
"""

from __future__ import annotations

import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)

from kernels.tree_attention import tree_attention
from vllm_adaptive_spec.adapter import step as tree_step

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


class TreeCPUAttentionMetadataBuilder(CPUAttentionMetadataBuilder):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        if self.isa not in PINNED_LAYOUTS:
            self.isa = "vec" if self.block_size % 32 == 0 else "vec16"
            self._set_isa_to_layers(layer_names)


class TreeCPUAttentionImpl(CPUAttentionBackendImpl):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        unsupported = {
            "sliding window": self.sliding_window != -1,
            "ALiBi": self.alibi_slopes is not None,
            "logits soft-cap": bool(self.logits_soft_cap),
            "attention sinks": self.sinks is not None,
            "quantized KV cache": self.is_fp8_kv_cache,
        }
        found = [name for name, present in unsupported.items() if present]
        if found and self.attn_type == AttentionType.DECODER:
            raise ValueError(f"adaptive_tree tree attention does not support {', '.join(found)} yet")

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None, output_block_scale=None):
        step = tree_step.current()
        rows = step if isinstance(step, tree_step.DraftStep) else getattr(step, "attention", None)
        tree_rows_only = (
            rows is not None
            and attn_metadata is not None
            and rows.query_rows.shape[0] == attn_metadata.num_actual_tokens
            and output_scale is None
        )
        if not tree_rows_only:
            output = super().forward(
                layer, query, key, value, kv_cache, attn_metadata, output, output_scale, output_block_scale
            )
        if rows is None or attn_metadata is None or self.attn_type != AttentionType.DECODER:
            return output
        key_cache, value_cache = cache_views(kv_cache)
        result = tree_attention(
            query[rows.query_rows],
            key_cache,
            value_cache,
            attn_metadata.block_table[rows.batch_indices],
            rows.query_start_loc,
            attn_metadata.seq_lens[rows.batch_indices],
            rows.query_mask,
            self.scale,
            rows.window_lens,
        )
        output.view(query.shape[0], self.num_heads, -1)[rows.query_rows] = result.to(output.dtype)
        return output


class TreeCPUAttentionBackend(CPUAttentionBackend):
    @staticmethod
    def get_impl_cls():
        return TreeCPUAttentionImpl

    @staticmethod
    def get_builder_cls():
        return TreeCPUAttentionMetadataBuilder
