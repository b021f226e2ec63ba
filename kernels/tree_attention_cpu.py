"""Native CPU tree attention: ``tree_attention_cpu.cpp``, built for the
machine's instruction set on first use and cached.

The op computes :func:`kernels.tree_attention.tree_attention_reference`'s
result over vLLM's ``CPU_ATTN`` cache in its ``vec`` layout, reading the
pages where they lie (no gather copy), float32 or bfloat16, grouped-query
attention, any head size and block size that are multiples of the vector
width. It is what vLLM's own CPU attention is (C++ in ``csrc/cpu``, one
kernel per instruction set), with the per-row mask a tree needs.

Decision: compiled on first use with ``torch.utils.cpp_extension.load``
(ATen and ``torch/library.h`` only, no pybind: about 10 s with g++ 12) into
torch's extension cache, rather than at install: a ``setup.py`` build would
run in pip's isolated environment against another torch, and on the machine
that builds rather than the one that runs. One library per instruction set
(AVX-512, AVX2, the baseline), its vectors sized to it: a 64-byte vector
compiled without AVX-512 runs many times slower.

``VLLM_ADAPTIVE_SPEC_CPU_ATTENTION`` picks the path: ``auto`` (the default:
the native op, or the torch path with one warning where it cannot be built,
say without a compiler), ``native`` (an error where it cannot be built) or
``torch``.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
from pathlib import Path
from typing import NamedTuple

import torch

SETTING = "VLLM_ADAPTIVE_SPEC_CPU_ATTENTION"
SOURCE = Path(__file__).with_name("tree_attention_cpu.cpp")
logger = logging.getLogger(__name__)


class Build(NamedTuple):
    """One instruction set's library: compiler flags, floats a vector, and
    the register tile of its matrix products (rows, vectors)."""

    flags: tuple[str, ...]
    vector: int
    tile_rows: int
    tile_vectors: int


BUILDS = {
    "avx512": Build(("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mfma"), 16, 6, 4),
    "avx2": Build(("-mavx2", "-mfma"), 8, 4, 2),
    "baseline": Build((), 4, 4, 2),
}


@functools.cache
def machine_isa() -> str:
    """The widest of :data:`BUILDS` this machine runs (torch's own reading of the CPU)."""
    capability = torch.backends.cpu.get_cpu_capability()
    return {"AVX512": "avx512", "AVX2": "avx2"}.get(capability, "baseline")


def setting() -> str:
    """The path asked for: ``auto``, ``native`` or ``torch``."""
    value = os.environ.get(SETTING, "auto").strip().lower() or "auto"
    if value not in ("auto", "native", "torch"):
        raise ValueError(f"{SETTING}={value!r}: expected auto, native or torch")
    return value


@functools.cache
def build(isa: str):
    """Compile (or find cached) the library for ``isa`` and return its op."""
    from torch.utils import cpp_extension

    spec = BUILDS[isa]
    namespace = f"adaptive_tree_{isa}"
    defines = [f"-DTREE_VEC={spec.vector}", f"-DTREE_MR={spec.tile_rows}", f"-DTREE_NV={spec.tile_vectors}",
               f"-DTREE_NS={namespace}"]
    quiet = io.StringIO()  # the compiler's and torch's chatter: a failure is reported in one line below
    with contextlib.redirect_stdout(quiet), contextlib.redirect_stderr(quiet):
        cpp_extension.load(name=f"adaptive_tree_cpu_{isa}", sources=[str(SOURCE)],
                           extra_cflags=["-O3", "-fopenmp", "-fno-math-errno", *spec.flags, *defines],
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
    return getattr(torch.ops, namespace).tree_attention


@functools.cache
def native_op():
    """The op this process uses, or None for the torch path (by
    :func:`setting`; ``auto`` warns once where the build fails)."""
    chosen = setting()
    if chosen == "torch":
        return None
    try:
        return build(machine_isa())
    except Exception as error:  # no compiler, no ninja, a failed build: all leave the torch path
        if chosen == "native":
            raise RuntimeError(f"{SETTING}=native, but the native CPU tree attention did not build: "
                               f"{_first_line(error)}") from error
        logger.warning("adaptive_tree: native CPU tree attention unavailable (%s); using the torch path "
                       "(set %s=torch to skip the build)", _first_line(error), SETTING)
        return None


def _first_line(error: Exception) -> str:
    text = str(error).strip().splitlines()
    return f"{type(error).__name__}: {text[0] if text else ''}"


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
