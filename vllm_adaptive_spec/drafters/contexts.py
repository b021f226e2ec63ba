"""A drafting step's contexts: rows of one token array, not one list per request.

The proposer names them in the engine's token array (``InputBatch.token_ids_cpu``)
without copying it (:meth:`Contexts.gather`); a drafter that works on the
whole batch (``retrieval_tensors``) takes them as one array (:attr:`Contexts.tokens`,
one gather), and one that works request by request (the retrieval trie)
iterates over the rows, which are views of the engine's array.

Decision (views, not a copy): the trie reads only the tokens new since the
last step of each row, so copying every drafting request's whole context
out of the engine's array (its longest row's width) each step was work
nobody read; and on the host right after the forward each numpy call
costs tens of microseconds, so the rows and lengths stay plain lists.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Contexts:
    """Each drafting request's context: row ``indices[k]`` of ``array`` up
    to ``lengths[k]`` (lists on the host)."""

    array: np.ndarray
    indices: list[int]
    lengths: list[int]

    @staticmethod
    def gather(token_ids: np.ndarray, rows: list[int], lengths: list[int],
               pending: Sequence[Sequence[int]] | None = None) -> "Contexts":
        """Rows ``rows`` of the engine's ``token_ids`` up to ``lengths``;
        ``pending``: each row's tokens sampled this step that ``token_ids``
        does not hold yet, the last of its ``lengths`` (model drafters run
        before vLLM's bookkeeping; those rows are then copied, the engine's
        array left as it is)."""
        if pending is None:
            return Contexts(token_ids, list(rows), list(lengths))
        tokens = token_ids[rows, : max(lengths, default=0)]
        for b, sampled in enumerate(pending):
            tokens[b, lengths[b] - len(sampled): lengths[b]] = sampled
        return Contexts(tokens, list(range(len(rows))), list(lengths))

    @staticmethod
    def of(contexts: Sequence[Sequence[int]]) -> "Contexts":
        """Contexts given one by one (tests, offline tools)."""
        lengths = [len(context) for context in contexts]
        tokens = np.zeros((len(contexts), max(lengths, default=1)), dtype=np.int64)
        for b, context in enumerate(contexts):
            tokens[b, : lengths[b]] = context
        return Contexts(tokens, list(range(len(contexts))), lengths)

    @property
    def tokens(self) -> np.ndarray:
        """[R, L] every context, left-aligned (beyond a row's length: anything)."""
        return self.array[self.indices, : max(self.lengths, default=0)]

    def rows(self, positions: Sequence[int]) -> "Contexts":
        """The contexts at ``positions`` (of this step's drafting requests)."""
        return Contexts(self.array, [self.indices[k] for k in positions], [self.lengths[k] for k in positions])

    def __len__(self) -> int:
        return len(self.lengths)

    def __iter__(self) -> Iterator[np.ndarray]:
        return (self.array[row, :n] for row, n in zip(self.indices, self.lengths))
