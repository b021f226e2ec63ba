"""The retrieval drafter (ALGORITHMS.md section 7, Talon, seed 001).

Each request keeps a token-level suffix index over its prompt and output so
far: for every n-gram length ``k <= l_max``, where each n-gram ended. To draft,
the longest suffix of the context (``l_max`` down to ``l_min`` tokens) that
occurred before is matched; the tokens that followed its most recent
``max_matches`` occurrences (up to ``max_depth`` each) are merged into a trie
whose counts give the draft probabilities: ``q`` of a child is its count share
among its siblings. A policy then picks the tree from that trie.

Decision: only the longest matching suffix is used (longer matches predict
better and the spec matches "length l_max down to 1"); the index is updated
incrementally, since a request's tokens are append-only.

Decision (calibration): a bare count share says a continuation seen once
after a one-token match is certain (``q = 1``), yet replaying the target's
greedy answers to the prompt set (``benchmarks/retrieval_calibration.py``)
such a node is accepted 32% of the time, and 94% after a 12-token match. A
node's chance of acceptance, given its parent's, rises with the evidence
behind it: its count ``c`` and the matched context ``L`` (the suffix match
plus the tree path above the node, which the target has then confirmed).
So the drafter's ``q`` is that chance, not the share::

    q = (c / n) * c / (c + kappa(L)),    kappa(L) = evidence_prior * L ** -1.3

with ``n`` the siblings' total count; ``evidence_prior = 0`` gives the
spec's plain share. The default (2.0) and the exponent were fitted on those
replays; path probabilities ``p`` are then expected acceptances, which the
policy's ``min_p`` and the budget compare with a node's cost.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from vllm_adaptive_spec.growth import Candidates
from vllm_adaptive_spec.policies import Param

ROOT_HANDLE = -1
EVIDENCE_EXPONENT = 1.3


@dataclass
class _Index:
    tokens: list[int] = field(default_factory=list)
    # ends[k][ngram] = positions where that k-gram ended, oldest first.
    ends: list[dict[tuple[int, ...], list[int]]] = field(default_factory=list)

    def extend(self, new_tokens: list[int], l_max: int) -> None:
        if not self.ends:
            self.ends = [defaultdict(list) for _ in range(l_max + 1)]
        tokens = self.tokens
        for token in new_tokens:
            tokens.append(token)
            end = len(tokens) - 1
            for k in range(1, min(l_max, len(tokens)) + 1):
                self.ends[k][tuple(tokens[-k:])].append(end)


@dataclass
class _Trie:
    """Children per node: ``children[node] = [(token, q, child), ...]``,
    sorted by descending ``q`` (ties: first seen first)."""

    children: list[list[tuple[int, float, int]]]


class RetrievalDrafter:
    """Suffix-index drafter; one trie per request per step."""

    name = "retrieval"
    PARAMS = {
        "l_max": Param(int, 8, "an integer >= 1", lambda v: v >= 1),
        "l_min": Param(int, 1, "an integer >= 1 and <= l_max", lambda v: v >= 1),
        "max_matches": Param(int, 32, "an integer >= 1", lambda v: v >= 1),
        "max_depth": Param(int, 16, "an integer >= 1", lambda v: v >= 1),
        "evidence_prior": Param(float, 2.0, "a number >= 0", lambda v: v >= 0),
    }

    def __init__(
        self, l_max: int = 8, l_min: int = 1, max_matches: int = 32, max_depth: int = 16, evidence_prior: float = 2.0
    ) -> None:
        if l_min > l_max:
            raise ValueError(f"l_min ({l_min}) must not exceed l_max ({l_max})")
        self.l_max, self.l_min = l_max, l_min
        self.max_matches, self.max_depth = max_matches, max_depth
        self.evidence_prior = evidence_prior
        self._indexes: dict[str, _Index] = {}
        self._tries: list[_Trie] = []

    def forget(self, request_id: str) -> None:
        self._indexes.pop(request_id, None)

    def prepare(self, request_ids: list[str], contexts: list[list[int]], rows=None) -> None:
        """Update each request's index with its context and build this step's tries."""
        self._tries = []
        for request_id, context in zip(request_ids, contexts):
            context = list(context)
            index = self._indexes.get(request_id)
            if index is None or context[: len(index.tokens)] != index.tokens:
                index = self._indexes[request_id] = _Index()
            index.extend(context[len(index.tokens):], self.l_max)
            self._tries.append(self._build_trie(index))

    def _build_trie(self, index: _Index) -> _Trie:
        tokens = index.tokens
        last = len(tokens) - 1
        starts: list[int] = []
        match_length = 0
        for k in range(min(self.l_max, len(tokens)), self.l_min - 1, -1):
            ends = index.ends[k].get(tuple(tokens[-k:]), [])
            starts = [end + 1 for end in ends if end < last][-self.max_matches:]
            if starts:
                match_length = k
                break
        counts: list[dict[int, list[int]]] = [{}]  # node -> token -> [count, child]
        depths = [0]
        for start in reversed(starts):  # most recent first: ties go to it
            node = 0
            for token in tokens[start:start + self.max_depth]:
                entry = counts[node].get(token)
                if entry is None:
                    entry = counts[node][token] = [0, len(counts)]
                    counts.append({})
                    depths.append(depths[node] + 1)
                entry[0] += 1
                node = entry[1]
        children = []
        for node, kids in enumerate(counts):
            if not kids:
                children.append([])
                continue
            total = sum(c for c, _ in kids.values())
            matched = match_length + depths[node]
            kappa = self.evidence_prior * matched ** -EVIDENCE_EXPONENT
            scored = [(tok, c / total * c / (c + kappa), child) for tok, (c, child) in kids.items()]
            children.append(sorted(scored, key=lambda e: -e[1]))
        return _Trie(children)

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        batch, width = handles.shape
        rows: list[list[list[tuple[int, float, int]]]] = []
        fanout = 1
        for b in range(batch):
            trie = self._tries[b]
            row = []
            for f in range(width):
                if not live[b, f]:
                    row.append([])
                    continue
                node = int(handles[b, f]) + 1  # the root handle -1 is trie node 0
                kids = trie.children[node]
                row.append([(tok, q, child - 1) for tok, q, child in kids])
                fanout = max(fanout, len(kids))
            rows.append(row)
        tokens = torch.full((batch, width, fanout), -1, dtype=torch.long)
        q = torch.zeros(batch, width, fanout)
        out_handles = torch.full((batch, width, fanout), ROOT_HANDLE, dtype=torch.long)
        for b, row in enumerate(rows):
            for f, kids in enumerate(row):
                for c, (tok, chance, child) in enumerate(kids):
                    tokens[b, f, c], q[b, f, c], out_handles[b, f, c] = tok, chance, child
        return Candidates(tokens, q, out_handles)
