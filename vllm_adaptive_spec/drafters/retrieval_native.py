"""The retrieval drafter's trie matcher in native code on the CPU
(``kernels/retrieval_trie_cpu.cpp``): the same trees as
:class:`~vllm_adaptive_spec.drafters.retrieval_trie.RetrievalDrafter`, its
reference, with the index, the match and the tries in one native object.

Chosen by :func:`~vllm_adaptive_spec.drafters.retrieval_tensors.make_retrieval`
for an engine on the CPU whose trie matches the request's own context only
(no shared datastore, no corpus: those stay in the reference) and whose
native library builds (``VLLM_ADAPTIVE_SPEC_CPU_ATTENTION``, as the
library's other ops).
"""

from __future__ import annotations

from kernels.retrieval_trie_cpu import native_tries
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter
from vllm_adaptive_spec.trees.tree import DraftTree


class NativeRetrievalDrafter(RetrievalDrafter):
    """:class:`RetrievalDrafter` of the same settings over a native
    ``RetrievalTries`` (:func:`kernels.retrieval_trie_cpu.native_tries`)."""

    def __init__(self, **params) -> None:
        super().__init__(**params)
        if self.shared is not None or self.corpus_path:
            raise ValueError("the native retrieval tries match the request's own context only")
        self._native = native_tries(self.l_max, self.l_min, self.max_matches, self.max_depth, self.evidence_prior)
        if self._native is None:
            raise RuntimeError("the native CPU library is not available (VLLM_ADAPTIVE_SPEC_CPU_ATTENTION)")

    def prepare(self, request_ids: list[str], contexts: Contexts, rows=None, prompt_lens=None) -> None:
        self._native.prepare(list(request_ids), contexts.array, contexts.indices, contexts.lengths)

    def children(self, b: int, handle: int) -> list[tuple[int, float, int]]:
        return list(zip(*self._native.children(b, handle)))

    def candidate_trees(self, floor: float = 0.0) -> list[DraftTree]:
        sizes, tokens, parents, q = self._native.candidate_trees(floor)
        trees, start = [], 0
        for size in sizes:
            end = start + size
            trees.append(DraftTree(tokens[start:end], parents[start:end], q[start:end]))
            start = end
        return trees

    def forget(self, request_id: str, finished: bool = False) -> None:
        self._native.forget(request_id)

    def requests_held(self) -> int:
        return self._native.requests_held()
