"""Move the KV of accepted tree nodes into consecutive cache slots, in place.

A slot ``s`` is (block ``s // block_size``, offset ``s % block_size``) of a
``[num_blocks, block_size, H, D]`` cache, read and written through its strides.
Each row of ``src_slots`` / ``dst_slots`` is one request's list of copies, ``-1``
entries being padding. A copy's source may be the destination of a later copy
in the same row, never of an earlier one, so the copies of a row run in order;
rows touch disjoint slots and run in parallel.

The Triton kernel runs one program per (row, head) that walks its row's pairs
in order, copying that head's K and V vectors.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def compact_kv_reference(
    key_cache: torch.Tensor, value_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Sequential torch loop over each row's pairs."""
    block_size = key_cache.shape[1]
    for src_row, dst_row in zip(src_slots.tolist(), dst_slots.tolist()):
        for src, dst in zip(src_row, dst_row):
            if src < 0 or src == dst:
                continue
            for cache in (key_cache, value_cache):
                cache[dst // block_size, dst % block_size] = cache[src // block_size, src % block_size]


if triton is not None:

    @triton.jit
    def _compact_kv_kernel(
        k_ptr,
        v_ptr,
        src_ptr,
        dst_ptr,
        num_pairs,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_src_r,
        stride_src_a,
        stride_dst_r,
        stride_dst_a,
        head_dim,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        for j in range(num_pairs):
            src = tl.load(src_ptr + row * stride_src_r + j * stride_src_a)
            dst = tl.load(dst_ptr + row * stride_dst_r + j * stride_dst_a)
            if (src >= 0) & (src != dst):
                k_src = (src // BLOCK_SIZE) * stride_kb + (src % BLOCK_SIZE) * stride_ks + head * stride_kh
                k_dst = (dst // BLOCK_SIZE) * stride_kb + (dst % BLOCK_SIZE) * stride_ks + head * stride_kh
                v_src = (src // BLOCK_SIZE) * stride_vb + (src % BLOCK_SIZE) * stride_vs + head * stride_vh
                v_dst = (dst // BLOCK_SIZE) * stride_vb + (dst % BLOCK_SIZE) * stride_vs + head * stride_vh
                k = tl.load(k_ptr + k_src + offs_d * stride_kd, mask=d_mask)
                v = tl.load(v_ptr + v_src + offs_d * stride_vd, mask=d_mask)
                tl.store(k_ptr + k_dst + offs_d * stride_kd, k, mask=d_mask)
                tl.store(v_ptr + v_dst + offs_d * stride_vd, v, mask=d_mask)
                # Threads holding replicated elements must all have read this pair's
                # source before any of them overwrites it as a later pair's destination.
                tl.debug_barrier()


def compact_kv_triton(
    key_cache: torch.Tensor, value_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """Launch the kernel on an (R, H) grid."""
    num_rows, num_pairs = src_slots.shape
    if num_rows == 0 or num_pairs == 0:
        return
    num_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    _compact_kv_kernel[(num_rows, num_heads)](
        key_cache,
        value_cache,
        src_slots,
        dst_slots,
        num_pairs,
        *key_cache.stride(),
        *value_cache.stride(),
        *src_slots.stride(),
        *dst_slots.stride(),
        head_dim,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def compact_kv(
    key_cache: torch.Tensor, value_cache: torch.Tensor, src_slots: torch.Tensor, dst_slots: torch.Tensor
) -> None:
    """In place: the Triton kernel on CUDA, the torch reference elsewhere."""
    impl = compact_kv_triton if triton is not None and key_cache.is_cuda else compact_kv_reference
    impl(key_cache, value_cache, src_slots, dst_slots)
