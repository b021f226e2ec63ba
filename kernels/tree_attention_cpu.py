"""Native CPU tree attention: ``tree_attention_cpu.cpp``, built for the
machine's instruction set on first use and cached.

The op computes :func:`kernels.tree_attention.tree_attention_reference`'s
result over vLLM's ``CPU_ATTN`` cache in its ``vec`` layout, reading the
pages where they lie (no gather copy), float32 or bfloat16, grouped-query
attention, any head size and block size that are multiples of the vector
width. It is what vLLM's own CPU attention is (C++ in ``csrc/cpu``, one
kernel per instruction set), with the per-row mask a tree needs.

It is built into the native CPU library (:mod:`kernels.cpu_library`: one
per instruction set, compiled on first use, its setting and its fallback to
the torch path).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.cpu_library import BUILDS, library, machine_isa, native_library


def build(isa: str):
    """The tree attention op of ``isa``'s library."""
    return library(isa).tree_attention


def native_op():
    """The tree attention op this process uses, or None for the torch path."""
    lib = native_library()
    return None if lib is None else lib.tree_attention


def supports(query: torch.Tensor, kv_cache: torch.Tensor) -> bool:
    """Whether the op covers this layer: one dtype (float32 or bfloat16),
    head and block sizes multiples of the vector width, pages contiguous."""
    vector = BUILDS[machine_isa()].vector
    _, _, block_size, two_d = kv_cache.shape
    return (query.dtype == kv_cache.dtype and query.dtype in (torch.float32, torch.bfloat16)
            and (two_d // 2) % vector == 0 and block_size % vector == 0
            and kv_cache.stride(3) == 1 and kv_cache.stride(2) == two_d and query.stride(2) == 1)


class NativeRows(NamedTuple):
    """One pass's tree rows as the op reads them, made by its first layer:
    int32 ``block_table`` [B, nb], ``query_start_loc`` [B + 1], ``seq_lens``
    and ``window_lens`` [B], and the contiguous bool ``query_mask`` [T, W]."""

    block_table: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    window_lens: torch.Tensor
    query_mask: torch.Tensor

    @staticmethod
    def of(block_table, query_start_loc, seq_lens, query_mask, window_lens=None) -> "NativeRows":
        starts = query_start_loc.to(torch.int32).contiguous()
        windows = starts.diff() if window_lens is None else window_lens
        return NativeRows(block_table.to(torch.int32).contiguous(), starts, seq_lens.to(torch.int32).contiguous(),
                          windows.to(torch.int32).contiguous(), query_mask.to(torch.bool).contiguous())


def tree_attention_cpu(op, query: torch.Tensor, kv_cache: torch.Tensor, rows: NativeRows, scale: float) -> torch.Tensor:
    """``[T, Hq, D]`` attention of ``query``'s tree rows over ``kv_cache``, by ``op`` (:func:`native_op`)."""
    return op(query, kv_cache, rows.block_table, rows.query_start_loc, rows.seq_lens, rows.window_lens,
              rows.query_mask, scale)
