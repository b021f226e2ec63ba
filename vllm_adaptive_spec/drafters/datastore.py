"""Token suffix indexes for the retrieval drafter: one per request, and the
shared datastore of earlier requests' outputs (Talon, docs/algorithms.md section 7).

An index maps every n-gram (``n <= l_max``) to the positions where it ended,
oldest first. The shared datastore concatenates documents with a separator
that no context contains, so no n-gram spans two documents and a
continuation stops at its document's end. It keeps at most ``max_tokens``
tokens: adding a document drops the oldest ones first, their index entries
are skipped by position and the index is rebuilt once the dropped tokens
outnumber the kept ones (amortised cost per token stays constant).
"""

from __future__ import annotations

import bisect
from collections import defaultdict, deque

SEPARATOR = -1


class SuffixIndex:
    """An append-only token list and, per n-gram length, where each n-gram ended."""

    def __init__(self, l_max: int) -> None:
        self.l_max = l_max
        self.tokens: list[int] = []
        self.ends: list[dict[tuple[int, ...], list[int]]] = [defaultdict(list) for _ in range(l_max + 1)]

    def extend(self, new_tokens) -> None:
        tokens, ends = self.tokens, self.ends
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens) - 1
            for k in range(1, min(self.l_max, len(tokens)) + 1):
                ends[k][tuple(tokens[-k:])].append(end)

    def match_ends(self, suffix: tuple[int, ...], first: int = 0) -> list[int]:
        """Positions (``>= first``) where ``suffix`` ended, oldest first."""
        ends = self.ends[len(suffix)].get(suffix)
        if not ends:
            return []
        return ends[bisect.bisect_left(ends, first):] if first else ends


class Datastore:
    """Earlier requests' outputs (or a corpus), bounded to ``max_tokens``, oldest dropped first."""

    def __init__(self, l_max: int, max_tokens: int) -> None:
        self.l_max, self.max_tokens = l_max, max_tokens
        self.clear()

    def clear(self) -> None:
        self._index = SuffixIndex(self.l_max)
        self._documents: deque[int] = deque()  # lengths, oldest first
        self._first = 0  # index position of the oldest kept token
        self.num_tokens = 0

    @property
    def tokens(self) -> list[int]:
        return self._index.tokens

    def add(self, document) -> None:
        document = list(document)[-self.max_tokens:]
        if not document:
            return
        self._index.extend([*document, SEPARATOR])
        self._documents.append(len(document))
        self.num_tokens += len(document)
        while self.num_tokens > self.max_tokens:
            dropped = self._documents.popleft()
            self.num_tokens -= dropped
            self._first += dropped + 1
        if self._first > len(self._index.tokens) - self._first:
            kept = self._index.tokens[self._first:]
            self._index = SuffixIndex(self.l_max)
            self._index.extend(kept)
            self._first = 0

    def match_ends(self, suffix: tuple[int, ...]) -> list[int]:
        """Kept positions where ``suffix`` ended, oldest first."""
        return self._index.match_ends(suffix, self._first)

    def continuation(self, start: int, length: int) -> list[int]:
        """Up to ``length`` tokens from ``start``, ending at the document's end."""
        tokens = self._index.tokens[start:start + length]
        return tokens[: tokens.index(SEPARATOR)] if SEPARATOR in tokens else tokens
