"""Native retrieval tries: ``retrieval_trie_cpu.cpp``, in the native CPU
library (:mod:`kernels.cpu_library`: built for the machine's instruction set
on first use and cached, its setting and its fallback).

One object holds every request's n-gram index and this step's tries, and
gives the trees of the Python reference
(:class:`vllm_adaptive_spec.drafters.retrieval_trie.RetrievalDrafter`, the
request's own context matched): the same nodes in the same order, the same
``q`` to the bit.

Decision: the reference keeps a dict of n-gram tuples per request and
builds each trie in Python, about 30 us a request every step, the largest
part of the retrieval drafter's drafting phase (0.25 ms of about 0.9 ms at
batch 8 on a 2-core Intel Xeon, where vLLM's ``suffix`` method drafts in
0.12-0.27 ms from Arctic Inference's C++ suffix tree). One native call per
step does the index and the match for the whole batch, one more gives the
trees above the step's floor. The object is a CPython type of the library's
module, not a torch custom class: right after the forward a custom class's
first method call alone took about 80 us (see the source's decision).
"""

from __future__ import annotations

from kernels.cpu_library import native_module


def native_tries(l_max: int, l_min: int, max_matches: int, max_depth: int, evidence_prior: float):
    """A native ``RetrievalTries`` of these settings, or None for the Python
    reference (the library's setting and build, :func:`kernels.cpu_library.native_library`)."""
    module = native_module()
    return None if module is None else module.RetrievalTries(l_max, l_min, max_matches, max_depth, evidence_prior)
