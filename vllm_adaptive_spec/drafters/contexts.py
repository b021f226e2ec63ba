"""A drafting step's contexts as one array, not one list per request.

The proposer takes them from the engine's token array (``InputBatch.token_ids_cpu``)
in one gather (:meth:`Contexts.gather`); a drafter that works on the whole
batch (``retrieval_tensors``) moves that array to its device as it is, and
one that works request by request (the retrieval trie) iterates over the rows.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Contexts:
    """``tokens`` [R, L]: each drafting request's context, left-aligned
    (beyond a row's length: anything); ``lengths`` [R]."""

    tokens: np.ndarray
    lengths: np.ndarray

    @staticmethod
    def gather(token_ids: np.ndarray, rows: np.ndarray, lengths: np.ndarray,
               pending: Sequence[Sequence[int]] | None = None) -> "Contexts":
        """Rows ``rows`` of the engine's ``token_ids`` up to ``lengths``;
        ``pending``: each row's tokens sampled this step that ``token_ids``
        does not hold yet, the last of its ``lengths`` (model drafters run
        before vLLM's bookkeeping)."""
        tokens = token_ids[rows, : int(lengths.max(initial=0))]
        if pending is not None:
            for b, sampled in enumerate(pending):
                tokens[b, int(lengths[b]) - len(sampled): int(lengths[b])] = sampled
        return Contexts(tokens, lengths)

    @staticmethod
    def of(contexts: Sequence[Sequence[int]]) -> "Contexts":
        """Contexts given one by one (tests, offline tools)."""
        lengths = np.array([len(context) for context in contexts], dtype=np.int64)
        tokens = np.zeros((len(contexts), int(lengths.max(initial=1))), dtype=np.int64)
        for b, context in enumerate(contexts):
            tokens[b, : lengths[b]] = context
        return Contexts(tokens, lengths)

    def rows(self, positions: Sequence[int]) -> "Contexts":
        """The contexts at ``positions`` (of this step's drafting requests)."""
        return Contexts(self.tokens[list(positions)], self.lengths[list(positions)])

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.tokens[b, :n] for b, n in enumerate(self.lengths.tolist()))
