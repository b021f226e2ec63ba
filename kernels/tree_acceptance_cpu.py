"""Native CPU tree acceptance: ``tree_acceptance_cpu.cpp``, in the native CPU
library (:mod:`kernels.cpu_library`: built for the machine's instruction
set on first use and cached, its setting and its fallback).

The op gives :func:`vllm_adaptive_spec.trees.verify.accept`'s result (the
torch reference: each tree's accepted path, the path's tokens and the bonus
token) in one pass over the trees' nodes, from their parents.

Decision: the reference is some thirty-five torch operations over a few
dozen nodes, one graph-safe sequence with no host read, which the GPU keeps.
On the CPU each of them is a dispatch on a host whose caches the forward has
just left cold: together 0.27 ms of every verified step at batch 1 on a
2-core Intel Xeon, where one native call does the same arithmetic.
"""

from __future__ import annotations

from kernels.cpu_library import native_library


def native_accept():
    """The acceptance op this process uses, or None for the torch reference
    (the library's setting and build, :func:`kernels.cpu_library.native_library`)."""
    lib = native_library()
    return None if lib is None else lib.accept_trees
