"""Move the KV of accepted tree nodes into consecutive cache slots, in place,
in every layer's cache.

A slot ``s`` is (block ``s // block_size``, offset ``s % block_size``) of a
``[num_blocks, block_size, H, D]`` cache, read and written through its strides.
Each row of ``src_slots`` / ``dst_slots`` is one request's list of copies, ``-1``
entries being padding. A copy's source may be the destination of a later copy
in the same row, never of an earlier one, so the copies of a row run in order;
rows touch disjoint slots and run in parallel.

Because no source is the destination of an earlier copy, reading every
source of a row before writing any destination gives the in-order result.
The Triton kernel does that: a program owns one row and a chunk of the
flattened (head, dim) elements, gathers all of the row's sources for that
chunk, waits at a barrier, and scatters them to their destinations, so a row
moves as a few wide loads and stores instead of a walk over its pairs. One
launch serves every layer: the layers' caches (one shape, one dtype, one set
of strides) are reached as element offsets from the first layer's, so the
grid's third axis is the layer.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from kernels.cpu_library import native_library

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def compact_kv_reference(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Sequential torch loop over each row's pairs, layer by layer."""
    pairs = list(zip(src_slots.tolist(), dst_slots.tolist()))
    for cache in (*key_caches, *value_caches):
        block_size = cache.shape[1]
        for src_row, dst_row in pairs:
            for src, dst in zip(src_row, dst_row):
                if src >= 0 and src != dst:
                    cache[dst // block_size, dst % block_size] = cache[src // block_size, src % block_size]


def compact_kv_cpu(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """Vectorised torch, the path off CUDA where the native library is not
    built: the pairs that move, then per layer every source gathered and
    scattered (the in-order result, as above). Off CUDA the slots are
    already on the host, so finding the moving pairs costs no wait; a step
    with none returns at once. Measured on 2 CPU cores (30 layers, 2 moves
    a request): 0.39 / 0.63 / 2.5 ms at batch 1 / 8 / 64, against 0.59 /
    4.6 / 40 ms for the reference's loop."""
    live = (src_slots >= 0) & (src_slots != dst_slots)
    src, dst = src_slots[live], dst_slots[live]
    if src.numel() == 0:
        return
    places: dict[int, tuple[torch.Tensor, ...]] = {}
    for cache in (*key_caches, *value_caches):
        size = cache.shape[1]
        if size not in places:
            places[size] = (src // size, src % size, dst // size, dst % size)
        src_block, src_offset, dst_block, dst_offset = places[size]
        cache[dst_block, dst_offset] = cache[src_block, src_offset]


if triton is not None:

    @triton.jit
    def _compact_kv_kernel(
        k_ptr,
        v_ptr,
        k_layers_ptr,
        v_layers_ptr,
        src_ptr,
        dst_ptr,
        num_pairs,
        head_dim,
        row_elements,
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
        BLOCK_SIZE: tl.constexpr,
        BLOCK_A: tl.constexpr,
        BLOCK_E: tl.constexpr,
    ):
        row = tl.program_id(0)
        k_ptr += tl.load(k_layers_ptr + tl.program_id(2))
        v_ptr += tl.load(v_layers_ptr + tl.program_id(2))
        offs_a = tl.arange(0, BLOCK_A)
        in_row = offs_a < num_pairs
        src = tl.load(src_ptr + row * stride_src_r + offs_a * stride_src_a, mask=in_row, other=-1)
        dst = tl.load(dst_ptr + row * stride_dst_r + offs_a * stride_dst_a, mask=in_row, other=-1)
        live = (src >= 0) & (src != dst)
        offs_e = tl.program_id(1) * BLOCK_E + tl.arange(0, BLOCK_E)
        head = offs_e // head_dim
        dim = offs_e % head_dim
        moved = live[:, None] & (offs_e < row_elements)[None, :]
        k_elem = (head * stride_kh + dim * stride_kd)[None, :]
        v_elem = (head * stride_vh + dim * stride_vd)[None, :]
        src_block, src_offset = (src // BLOCK_SIZE)[:, None], (src % BLOCK_SIZE)[:, None]
        dst_block, dst_offset = (dst // BLOCK_SIZE)[:, None], (dst % BLOCK_SIZE)[:, None]
        k = tl.load(k_ptr + src_block * stride_kb + src_offset * stride_ks + k_elem, mask=moved)
        v = tl.load(v_ptr + src_block * stride_vb + src_offset * stride_vs + v_elem, mask=moved)
        # Every thread has read its sources before any thread overwrites one of
        # them as a later pair's destination.
        tl.debug_barrier()
        tl.store(k_ptr + dst_block * stride_kb + dst_offset * stride_ks + k_elem, k, mask=moved)
        tl.store(v_ptr + dst_block * stride_vb + dst_offset * stride_vs + v_elem, v, mask=moved)


@functools.lru_cache(maxsize=16)
def _layer_offsets(addresses: tuple[int, ...], element_size: int, device: torch.device) -> torch.Tensor:
    """Each layer's cache as an element offset from the first layer's (the
    runner passes the same caches every step, so this is built once)."""
    return torch.tensor([(a - addresses[0]) // element_size for a in addresses], dtype=torch.int64, device=device)


def _uniform_layers(caches: Sequence[torch.Tensor]) -> torch.Tensor:
    """The caches' offsets, after checking they share shape, dtype and strides."""
    first = caches[0]
    for cache in caches[1:]:
        if (cache.shape, cache.stride(), cache.dtype, cache.device) != (first.shape, first.stride(), first.dtype, first.device):
            raise ValueError("compact_kv: every layer's cache needs one shape, stride, dtype and device")
    addresses = tuple(c.data_ptr() for c in caches)
    if any((a - addresses[0]) % first.element_size() for a in addresses):
        raise ValueError("compact_kv: layer caches must be aligned to their element size")
    return _layer_offsets(addresses, first.element_size(), first.device)


def compact_kv_triton(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
    block_e: int = 512,
    num_warps: int = 4,
) -> None:
    """One launch on an (R, chunks of ``block_e`` (head, dim) elements, layers) grid."""
    num_rows, num_pairs = src_slots.shape
    if num_rows == 0 or num_pairs == 0 or not key_caches:
        return
    key_cache, value_cache = key_caches[0], value_caches[0]
    num_heads, head_dim = key_cache.shape[2], key_cache.shape[3]
    row_elements = num_heads * head_dim
    block_e = min(block_e, triton.next_power_of_2(row_elements))
    _compact_kv_kernel[(num_rows, triton.cdiv(row_elements, block_e), len(key_caches))](
        key_cache,
        value_cache,
        _uniform_layers(key_caches),
        _uniform_layers(value_caches),
        src_slots,
        dst_slots,
        num_pairs,
        head_dim,
        row_elements,
        *key_cache.stride(),
        *value_cache.stride(),
        *src_slots.stride(),
        *dst_slots.stride(),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_A=triton.next_power_of_2(num_pairs),
        BLOCK_E=block_e,
        num_warps=num_warps,
    )


def _on_gpu(tensor: torch.Tensor) -> bool:
    return triton is not None and tensor.is_cuda


def compact_kv(
    key_caches: Sequence[torch.Tensor],
    value_caches: Sequence[torch.Tensor],
    src_slots: torch.Tensor,
    dst_slots: torch.Tensor,
) -> None:
    """In place, every layer: the Triton kernel on CUDA (one launch per group
    of layers that share a shape, dtype and strides, e.g. the target's and a
    draft model's of another head size); elsewhere the native CPU op
    (``kv_compaction_cpu.cpp``, in :mod:`kernels.cpu_library`: every layer in
    one call, 60 index copies for the demo model's 30 layers in torch), or
    :func:`compact_kv_cpu` where the library is not built."""
    if not _on_gpu(key_caches[0]):
        lib = native_library()
        if lib is None:
            compact_kv_cpu(key_caches, value_caches, src_slots, dst_slots)
        else:
            lib.compact_kv([*key_caches, *value_caches], src_slots, dst_slots)
        return
    groups: dict[tuple, list[int]] = {}
    for layer, (key, value) in enumerate(zip(key_caches, value_caches)):
        groups.setdefault((key.shape, key.stride(), value.stride(), key.dtype), []).append(layer)
    for layers in groups.values():
        compact_kv_triton([key_caches[i] for i in layers], [value_caches[i] for i in layers], src_slots, dst_slots)
