"""The retrieval drafter (docs/algorithms.md section 7, Talon, seed 001).

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
spec's plain share. The exponent was fitted on those replays; path
probabilities ``p`` are then expected acceptances (up to a scale the load
budget measures, its calibration ``factor``), which the policy's ``min_p`` and the budget
compare with a node's cost.

Decision (``evidence_prior`` 4.0): 2.0 fits acceptance best over all trie
nodes (log-loss), but over-predicts the nodes near the load budget's cut
(predicted 0.2-0.5, accepted 0.16-0.35); the same replays costed at this
machine's step and row costs (``benchmarks/retrieval_calibration.py``,
setting ``load-budget``) give 1.379x at batch 1 with 4.0 against 1.357x with
2.0 for 64-token answers, 1.572x against 1.553x for 128-token ones, higher
or level in 6 of 7 prompt categories.

Shared datastore (``datastore: "shared"``, off by default): the outputs of
finished requests, at most ``datastore_tokens`` of them, oldest dropped first;
``corpus`` adds a text file's paragraphs, kept for the engine's life. The
longest suffix is then matched in the request's own index and in these; at
that length the request's own occurrences come first (most recent first),
then the datastore's, up to ``max_matches``, all counted in one trie. Off by
default because it lets one user's request draft from another's answer: the
drafts are only proposals that the target verifies, so outputs are
unchanged, but acceptance rates (and so timing) then depend on other users'
text.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from vllm_adaptive_spec.config_schema import Param
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.datastore import Datastore, SuffixIndex
from vllm_adaptive_spec.trees.candidates import Candidates, Growth
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree

ROOT_HANDLE = -1
EVIDENCE_EXPONENT = 1.3
MATCHERS = ("auto", "trie", "tensors")


def resolve_matcher(matcher: str, datastore: str = "off", corpus: str = "") -> str:
    """Which implementation builds the trees (the same trees): ``trie`` (this
    module: an incremental suffix index and lazy tries, in Python; on the
    CPU in native code, ``retrieval_native``, where it applies) or
    ``tensors`` (``retrieval_tensors``: batched tensor operations where the
    tokens are). ``auto`` is the trie on every platform: several times
    faster on the CPU (``benchmarks/results/history.md``, 2026-11-28); on
    CUDA the tensors are not measured yet (``scripts/gpu_checks.sh``
    compares both) and they read their trees back once a drafting step. The shared datastore and the
    corpus are matched by the trie only."""
    others = datastore != "off" or bool(corpus)
    if matcher == "tensors" and others:
        raise ValueError("retrieval matcher 'tensors' matches the request's own context only; "
                         "datastore 'shared' and corpus need matcher 'trie' (or 'auto')")
    return "trie" if matcher == "auto" else matcher


def matcher_of(params: dict) -> str:
    """:func:`resolve_matcher` for a drafter's parameters (defaults where unset)."""
    return resolve_matcher(params.get("matcher", "auto"), params.get("datastore", "off"), params.get("corpus", ""))


def _readable_file(path: str) -> bool:
    return path == "" or (os.path.isfile(path) and os.access(path, os.R_OK))


def _extends(context, tokens: list[int], checked: int = 16) -> bool:
    """Whether ``context`` (a list or a 1-D array) continues ``tokens``,
    judged by their last ``checked`` tokens: a request's context only grows
    (vLLM reports preemption, and the index is then forgotten), so this
    catches a reused request id without comparing the whole context every
    step."""
    n = len(tokens)
    return n <= len(context) and _as_list(context[max(n - checked, 0):n]) == tokens[max(n - checked, 0):]


def _as_list(tokens) -> list[int]:
    return tokens.tolist() if hasattr(tokens, "tolist") else list(tokens)


class _Trie:
    """A request's retrieved continuations as a trie whose nodes are built on
    first use: a node is the continuations that pass through it (in priority
    order), and its children group them by their next token. Decision: built
    lazily, since only the nodes above a floor on ``p`` are read (the
    retrieval policy's ``min_p``, the load budget's :meth:`floor`): on the
    prompt set's answers a trie has 23 nodes on average and 6 reach ``min_p``
    0.05; the drafter's whole time a step (index, tries, policy, load
    budget), replayed offline at batch 64, is 6.7-7.7 ms with lazy tries
    against 10.1-10.3 ms with whole ones."""

    def __init__(self, continuations: list[list[int]], match_length: int, evidence_prior: float) -> None:
        self.continuations = continuations
        self.match_length, self.evidence_prior = match_length, evidence_prior
        self.members: list[list[int]] = [list(range(len(continuations)))]  # node -> its continuations
        self.depths = [0]
        self.kids: list[list[tuple[int, float, int]] | None] = [None]

    def children(self, node: int) -> list[tuple[int, float, int]]:
        """``[(token, q, child), ...]`` of ``node`` (0: the root), by
        descending ``q`` (ties: first seen first)."""
        kids = self.kids[node]
        if kids is None:
            kids = self.kids[node] = self._expand(node)
        return kids

    def _expand(self, node: int) -> list[tuple[int, float, int]]:
        depth = self.depths[node]
        groups: dict[int, list[int]] = {}
        for i in self.members[node]:
            continuation = self.continuations[i]
            if depth < len(continuation):
                groups.setdefault(continuation[depth], []).append(i)
        if not groups:
            return []
        total = sum(len(members) for members in groups.values())
        kappa = self.evidence_prior * (self.match_length + depth) ** -EVIDENCE_EXPONENT
        scored = []
        for token, members in groups.items():
            count = len(members)
            scored.append((token, count / total * count / (count + kappa), len(self.members)))
            self.members.append(members)
            self.depths.append(depth + 1)
            self.kids.append(None)
        scored.sort(key=lambda e: -e[1])
        return scored


class RetrievalDrafter:
    """Suffix-index drafter; one trie per request per step."""

    name = "retrieval"
    growth = Growth.WHOLE_TREES  # every candidate is known before growth (``candidate_trees``)
    PARAMS = {
        "l_max": Param(int, 8, "an integer >= 1", lambda v: v >= 1),
        "l_min": Param(int, 1, "an integer >= 1 and <= l_max", lambda v: v >= 1),
        "max_matches": Param(int, 32, "an integer >= 1", lambda v: v >= 1),
        "max_depth": Param(int, 16, "an integer >= 1", lambda v: v >= 1),
        "evidence_prior": Param(float, 4.0, "a number >= 0", lambda v: v >= 0),
        "datastore": Param(str, "off", "one of 'off', 'shared'", lambda v: v in ("off", "shared")),
        "datastore_tokens": Param(int, 100_000, "an integer >= 1", lambda v: v >= 1),
        "corpus": Param(str, "", "the path of a readable text file, or '' for none", _readable_file),
        "matcher": Param(str, "auto", "one of 'auto', 'trie', 'tensors'", lambda v: v in MATCHERS),
    }

    def __init__(
        self,
        l_max: int = 8,
        l_min: int = 1,
        max_matches: int = 32,
        max_depth: int = 16,
        evidence_prior: float = 4.0,
        datastore: str = "off",
        datastore_tokens: int = 100_000,
        corpus: str = "",
        matcher: str = "auto",
    ) -> None:
        resolve_matcher(matcher, datastore, corpus)  # refuses what no matcher allows
        if l_min > l_max:
            raise ValueError(f"l_min ({l_min}) must not exceed l_max ({l_max})")
        self.l_max, self.l_min = l_max, l_min
        self.max_matches, self.max_depth = max_matches, max_depth
        self.evidence_prior = evidence_prior
        self.shared = Datastore(l_max, datastore_tokens) if datastore == "shared" else None
        self.corpus_path = corpus
        self.corpus: Datastore | None = None
        self._indexes: dict[str, SuffixIndex] = {}
        self._prompt_lens: dict[str, int] = {}
        self._tries: list[_Trie] = []

    def load_corpus(self, tokenize: Callable[[str], list[int]]) -> None:
        """Index the ``corpus`` file's paragraphs (blank-line separated), if one is set."""
        if not self.corpus_path:
            return
        with open(self.corpus_path, encoding="utf-8") as handle:
            paragraphs = [p for p in handle.read().split("\n\n") if p.strip()]
        documents = [tokenize(p) for p in paragraphs]
        self.corpus = Datastore(self.l_max, max(1, sum(len(d) for d in documents)))
        for document in documents:
            self.corpus.add(document)

    def forget(self, request_id: str, finished: bool = False) -> None:
        """Drop a request's index; a finished request's output joins the shared datastore."""
        index = self._indexes.pop(request_id, None)
        prompt_len = self._prompt_lens.pop(request_id, 0)
        if finished and index is not None and self.shared is not None:
            self.shared.add(index.tokens[prompt_len:])

    def requests_held(self) -> int:
        """How many requests have an index (the shared datastore is not per request)."""
        return len(self._indexes.keys() | self._prompt_lens.keys())

    def clear_shared(self) -> int:
        """Empty the shared datastore (benchmarks, between timed passes); returns the tokens dropped."""
        if self.shared is None:
            return 0
        dropped = self.shared.num_tokens
        self.shared.clear()
        return dropped

    def prepare(self, request_ids: list[str], contexts: Contexts, rows=None, prompt_lens=None) -> None:
        """Update each request's index with its context and build this step's
        tries. ``prompt_lens`` (where known) marks where each request's output
        starts; otherwise it starts at the first context seen."""
        self._tries = []
        for b, (request_id, context) in enumerate(zip(request_ids, contexts)):
            index = self._indexes.get(request_id)
            if index is None or not _extends(context, index.tokens):
                index = self._indexes[request_id] = SuffixIndex(self.l_max)
                self._prompt_lens[request_id] = len(context) if prompt_lens is None else int(prompt_lens[b])
            # Only the tokens new since the last step leave the array (not the whole context).
            index.extend(_as_list(context[len(index.tokens):]))
            self._tries.append(self._build_trie(index))

    def _matches(self, index: SuffixIndex) -> tuple[int, list[list[int]]]:
        """The longest matched suffix's length and the continuations that
        followed it: the request's own (most recent first), then the shared
        datastore's and the corpus's, at most ``max_matches``."""
        tokens = index.tokens
        last = len(tokens) - 1
        stores = [store for store in (self.shared, self.corpus) if store is not None]
        for k in range(min(self.l_max, len(tokens)), self.l_min - 1, -1):
            suffix = tuple(tokens[-k:])
            own = [end + 1 for end in index.match_ends(suffix)[-self.max_matches - 1:] if end < last][-self.max_matches:]
            found = [tokens[start:start + self.max_depth] for start in reversed(own)]
            for store in stores:
                room = self.max_matches - len(found)
                if room <= 0:
                    break
                ends = store.match_ends(suffix)[-room:]
                found += [c for c in (store.continuation(end + 1, self.max_depth) for end in reversed(ends)) if c]
            if found:
                return k, found
        return 0, []

    def _build_trie(self, index: SuffixIndex) -> _Trie:
        match_length, continuations = self._matches(index)
        return _Trie(continuations, match_length, self.evidence_prior)

    def children(self, b: int, handle: int) -> list[tuple[int, float, int]]:
        """Request ``b``'s trie children of the node ``handle`` (-1: the root),
        as (token, q, child handle), by descending ``q``."""
        return [(tok, q, child - 1) for tok, q, child in self._tries[b].children(handle + 1)]

    def candidate_trees(self, floor: float = 0.0) -> list[DraftTree]:
        """This step's tries as trees, breadth-first, children by descending
        ``q``; only the nodes whose path probability is at least ``floor``
        (closed under ancestors, as ``p`` never rises along a path)."""
        trees = []
        for trie in self._tries:
            tree, queue = DraftTree(), [(0, ROOT, 1.0)]
            for node, index, p in queue:
                for token, chance, child in trie.children(node):
                    child_p = p * chance
                    if child_p < floor:
                        break  # the rest are less likely still
                    queue.append((child, len(tree), child_p))
                    tree.tokens.append(token)
                    tree.parents.append(index)
                    tree.q.append(chance)
            trees.append(tree)
        return trees

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        batch, width = handles.shape
        handles_l, live_l = handles.tolist(), live.tolist()
        rows = [[self.children(b, h) if ok else [] for h, ok in zip(hs, oks)]
                for b, (hs, oks) in enumerate(zip(handles_l, live_l))]
        fanout = max([1] + [len(kids) for row in rows for kids in row])
        empty = (-1, 0.0, ROOT_HANDLE)
        table = [[kids + [empty] * (fanout - len(kids)) for kids in row] for row in rows]
        tokens = torch.tensor([[[c[0] for c in kids] for kids in row] for row in table], dtype=torch.long)
        q = torch.tensor([[[c[1] for c in kids] for kids in row] for row in table], dtype=torch.float32)
        out_handles = torch.tensor([[[c[2] for c in kids] for kids in row] for row in table], dtype=torch.long)
        return Candidates(tokens, q, out_handles)
