"""The retrieval drafter's trees as batched tensor operations.

The same trees as :class:`~vllm_adaptive_spec.drafters.retrieval_trie.RetrievalDrafter`
(its suffix index and lazy tries), ties included, computed for a whole batch
at once from its tokens ``[B, L]`` (each request's context, left-aligned,
``lengths`` [B]), so that they can run where the tokens are (the GPU) with a
number of operations that depends on neither the batch nor the contexts:

1. :func:`longest_matches`: for every length ``k`` from ``l_min`` to
   ``l_max``, where the context's last ``k`` tokens occurred before (a
   comparison of every position with the suffix, ``[B, L, l_max]``); the
   longest such ``k`` and its most recent ``max_matches`` ends.
2. :func:`continuations`: the ``max_depth`` tokens after each end ``[B, M, D]``.
3. :func:`candidate_trees`: the trie of those continuations by prefix
   (continuations ``i`` and ``j`` share the node at depth ``d`` when their
   first ``d + 1`` tokens agree; a node is named by its first continuation),
   each node's ``q`` from its count and its siblings' total as
   ``retrieval.py`` defines it, path probabilities, the nodes at or above
   the floor, and their breadth-first order (children by descending ``q``,
   first seen first), in one round of operations for all depths.

The evidence prior ``kappa`` takes one value per matched length plus depth;
those values are computed on the host, as the drafter computes them, so that
every ``q`` and ``p`` is the same float.

Decision (``matcher: auto``): the trie, for now on CUDA too. On the CPU the
tensors compare every position of every context with the suffix and every
pair of continuations, where the trie updates its index with the step's new
tokens and builds only the nodes it is asked for; the tensor version measured
several times slower there (``benchmarks/results/history.md``, 2026-11-28).
On CUDA it is not measured yet, and its trees are read back once a drafting
step (the load budget and vLLM's scheduler take them on the host), a
synchronisation the trie does not add; ``scripts/gpu_checks.sh`` runs both.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from kernels.cpu_library import native_library
from kernels.tree_gating import keep_best
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_native import NativeRetrievalDrafter
from vllm_adaptive_spec.drafters.retrieval_trie import EVIDENCE_EXPONENT, RetrievalDrafter, matcher_of
from vllm_adaptive_spec.trees.candidates import Candidates, Growth
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree

PAD = -1


class Matches(NamedTuple):
    """``length`` [B]: the longest matched suffix (0: none); ``ends`` [B, M]:
    where it ended before, most recent first (-1: no more)."""

    length: torch.Tensor
    ends: torch.Tensor


class CandidateTrees(NamedTuple):
    """Breadth-first trees ``[B, N]``: ``tokens``, ``parents`` (-1: the
    root's child), ``q`` and path probabilities ``p`` (float64),
    ``num_nodes`` [B]; slots beyond a tree's nodes hold -1 / -1 / 0 / 0."""

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor
    num_nodes: torch.Tensor
    p: torch.Tensor

    def to_trees(self) -> list[DraftTree]:
        """On the host, in one read: the slots packed into one int64 copy
        (``q``'s float64 bits as they are), then split there."""
        width = self.tokens.shape[1]
        packed = torch.cat([self.tokens, self.parents, self.q.view(torch.int64), self.num_nodes.unsqueeze(1)], dim=1)
        packed = packed.cpu()
        tokens, parents = packed[:, :width].tolist(), packed[:, width: 2 * width].tolist()
        q, counts = packed[:, 2 * width: 3 * width].view(torch.float64).tolist(), packed[:, -1].tolist()
        return [DraftTree(t[:n], r[:n], w[:n]) for t, r, w, n in zip(tokens, parents, q, counts)]

    def best(self, max_nodes: torch.Tensor, width: int) -> "CandidateTrees":
        """Each tree's ``max_nodes`` [B] nodes of highest ``p`` (ties: the
        earlier node), as :meth:`DraftTree.keep_best` keeps them (closed under
        ancestors), breadth-first in ``width`` slots (at least the largest
        ``max_nodes``): the retrieval policy's choice for a whole batch, on the
        trees' device, so that only the chosen nodes are read back."""
        slots = self.tokens.shape[1]
        real = torch.arange(slots, device=self.tokens.device) < self.num_nodes.unsqueeze(1)
        keep = keep_best(self.p, real, max_nodes)
        place = keep.long().cumsum(1) - 1
        parents = torch.where(self.parents >= 0, place.gather(1, self.parents.clamp(min=0)), ROOT)
        slot = torch.where(keep, place, width)
        return CandidateTrees(_placed(self.tokens, slot, width, PAD), _placed(parents, slot, width, ROOT),
                              _placed(self.q, slot, width, 0.0), keep.sum(1), _placed(self.p, slot, width, 0.0))


def _placed(values: torch.Tensor, slot: torch.Tensor, columns: int, fill) -> torch.Tensor:
    """``values`` [B, ...] flattened into ``columns`` slots a row at ``slot``
    (same shape; ``columns``: a spill column, cut off)."""
    out = torch.full((values.shape[0], columns + 1), fill, dtype=values.dtype, device=values.device)
    return out.scatter_(1, slot.flatten(1), values.flatten(1))[:, :columns]


def longest_matches(tokens: torch.Tensor, lengths: torch.Tensor, l_min: int, l_max: int, max_matches: int) -> Matches:
    batch, width = tokens.shape
    device = tokens.device
    last = lengths - 1
    back = torch.arange(l_max, device=device)  # t: tokens back from an end
    ends = torch.arange(width, device=device)
    suffix = tokens.gather(1, (last.unsqueeze(1) - back).clamp(min=0))  # [B, l_max], the t-th token back
    window = tokens[:, (ends.unsqueeze(1) - back).clamp(min=0)]  # [B, L, l_max]
    equal = (window == suffix.unsqueeze(1)) & (ends.unsqueeze(1) >= back) & (last.view(-1, 1, 1) >= back)
    runs = _all_so_far(equal)  # runs[b, j, k-1]: the suffix of length k ends at j
    before = ends.unsqueeze(0) < last.unsqueeze(1)  # the suffix's own occurrence is not a match
    found = (runs & before.unsqueeze(2)).any(1)  # [B, l_max]
    sizes = torch.arange(1, l_max + 1, device=device)
    length = torch.where(found & (sizes >= l_min), sizes, 0).amax(1)
    at = runs.gather(2, (length - 1).clamp(min=0).view(-1, 1, 1).expand(batch, width, 1)).squeeze(2)
    matched = at & before & (length > 0).unsqueeze(1)
    recent = torch.where(matched, ends, PAD)
    if width < max_matches:
        recent = torch.nn.functional.pad(recent, (0, max_matches - width), value=PAD)
    return Matches(length, recent.topk(max_matches, dim=1).values)


def _all_so_far(flags: torch.Tensor) -> torch.Tensor:
    """Along the last dimension, whether every flag up to each position is set
    (a cumulative sum of the unset ones: CPU ``cummin`` is many times slower)."""
    return torch.cumsum((~flags).to(torch.int32), dim=-1) == 0


def continuations(tokens: torch.Tensor, lengths: torch.Tensor, ends: torch.Tensor, max_depth: int) -> torch.Tensor:
    """``[B, M, D]`` the tokens after each end (-1 beyond the context or where there is no end)."""
    at = ends.unsqueeze(2) + 1 + torch.arange(max_depth, device=tokens.device)
    valid = (ends.unsqueeze(2) >= 0) & (at < lengths.view(-1, 1, 1))
    picked = tokens.gather(1, at.clamp(max=tokens.shape[1] - 1).flatten(1)).view(at.shape)
    return torch.where(valid, picked, PAD)


def evidence_table(evidence_prior: float, l_max: int, max_depth: int, exponent: float) -> list[float]:
    """``kappa`` for every matched length plus depth (index 0 unused), as the host drafter computes it."""
    return [0.0] + [evidence_prior * v ** -exponent for v in range(1, l_max + max_depth + 1)]


def candidate_trees(cont: torch.Tensor, length: torch.Tensor, kappa: torch.Tensor, floor: float) -> CandidateTrees:
    """The trie of the continuations ``cont`` [B, M, D] (priority order)
    after a match of ``length`` [B], as breadth-first trees of the nodes
    whose path probability is at least ``floor``; ``kappa`` float64
    (:func:`evidence_table`)."""
    batch, matches, depth = cont.shape
    valid = cont >= 0
    pair = (cont.unsqueeze(2) == cont.unsqueeze(1)) & valid.unsqueeze(2) & valid.unsqueeze(1)  # [B, M, M, D]
    same = _all_so_far(pair)  # the same prefix up to each depth
    names = torch.arange(matches, device=cont.device).view(1, 1, -1, 1)
    # [B, M, D]: a node's name, its first continuation (past a continuation's end: any name)
    first = torch.where(same, names, matches - 1).amin(2)
    node = valid & (first == torch.arange(matches, device=cont.device).view(1, -1, 1))
    count = same.sum(2).to(torch.float64)
    # The siblings' total: the continuations through the parent (the root: all) that go one deeper.
    total = torch.cat([valid[..., :1].sum(1, keepdim=True).expand(batch, matches, 1),
                       (same[..., :-1] & valid.unsqueeze(1)[..., 1:]).sum(2)], dim=2).to(torch.float64)
    evidence = kappa[(length.view(-1, 1, 1) + torch.arange(depth, device=cont.device)).clamp(max=kappa.shape[0] - 1)]
    q = torch.where(valid, count / total.clamp(min=1) * count / (count + evidence), 0.0)
    along = q.gather(1, first)  # the q of each continuation's nodes, down its path
    p = [along[..., 0]]
    for d in range(1, depth):  # left to right, as the host multiplies
        p.append(p[-1] * along[..., d])
    p = torch.stack(p, dim=2)
    return _breadth_first(cont, first, q, p, node & (p >= floor), same)


def _breadth_first(cont, first, q, p, kept, same) -> CandidateTrees:
    """The kept nodes in breadth-first order: depth by depth, within a depth
    by their parents' places, then descending ``q``, then name. That order
    is lexicographic in the path: two nodes of one depth are ordered as their
    ancestors are where their paths part (siblings there, ordered by ``q``
    then name). So a node's place is the count of kept nodes above its depth
    plus the kept nodes of its depth whose path parts from its own towards
    an earlier sibling, counted for every pair at once: the same operations
    at every depth, none per depth (``same``: [B, M, M, D], the pairs'
    common prefixes)."""
    _, matches, depth = cont.shape
    parting = same.sum(3).clamp(max=depth - 1)  # [B, M, M]: the depth where two continuations part
    q_at, name_at = q.gather(2, parting), first.gather(2, parting)  # m's ancestor there, for every m'
    q_other, name_other = q_at.transpose(1, 2), name_at.transpose(1, 2)
    ahead = (q_at > q_other) | ((q_at == q_other) & (name_at < name_other))  # [b, m, m']: m's side first
    level = kept.sum(1)  # [B, D]
    above = level.cumsum(1) - level
    # Counts of at most M, exact in float32 (and in TF32's products and float32 sums).
    earlier = torch.bmm(ahead.transpose(1, 2).float(), kept.float()).long()  # [B, M, D]
    index = torch.where(kept, above.unsqueeze(1) + earlier, PAD)
    through = index.gather(1, first)  # the place of the node each continuation passes at each depth
    parent = torch.cat([torch.full_like(through[..., :1], ROOT), through[..., :-1]], dim=2)
    slots = matches * depth
    slot = torch.where(kept, index, slots)
    return CandidateTrees(_placed(cont, slot, slots, PAD), _placed(parent, slot, slots, ROOT),
                          _placed(q, slot, slots, 0.0), level.sum(1), _placed(p, slot, slots, 0.0))


def make_retrieval(device_type: str = "cpu", **params) -> RetrievalDrafter:
    """The retrieval drafter of ``params`` for an engine on ``device_type``
    (where the tensor matcher keeps its tensors): the trie or the tensors,
    as its ``matcher`` resolves; on the CPU the trie in native code where the
    native library builds and the trie matches the request's own context
    only (``retrieval_native``), else its Python reference."""
    if matcher_of(params) == "tensors":
        return TensorRetrievalDrafter(device_type, **params)
    own_context = params.get("datastore", "off") == "off" and not params.get("corpus")
    if device_type == "cpu" and own_context and native_library() is not None:
        return NativeRetrievalDrafter(**params)
    return RetrievalDrafter(**params)


class TensorRetrievalDrafter(RetrievalDrafter):
    """The retrieval drafter with ``matcher: tensors``: each step's trees from
    the requests' whole contexts on ``device`` (no index kept between steps),
    the same trees as the trie's. The trees reach the host in one read, where
    the policy, the load budget and the scheduler take them."""

    growth = Growth.WHOLE_TENSORS  # ``candidate_tensors`` on its device, ``candidate_trees`` from them

    def __init__(self, device: str | torch.device = "cpu", **params) -> None:
        super().__init__(**params)
        self.device = torch.device(device)
        self._kappa = torch.tensor(evidence_table(self.evidence_prior, self.l_max, self.max_depth, EVIDENCE_EXPONENT),
                                   dtype=torch.float64, device=self.device)
        self._tokens = self._lengths = None
        self._cached: dict[float, list[DraftTree]] = {}
        self._whole: CandidateTrees | None = None  # this step's whole trees, on the device (``expand``)

    def prepare(self, request_ids: list[str], contexts: Contexts, rows=None, prompt_lens=None) -> None:
        self._tokens = torch.from_numpy(contexts.tokens).to(self.device, torch.long, non_blocking=True)
        self._lengths = torch.tensor(contexts.lengths, dtype=torch.long).to(self.device, non_blocking=True)
        self._cached, self._whole = {}, None

    def candidate_tensors(self, floor: float = 0.0) -> CandidateTrees:
        """This step's whole trees at ``floor`` on the device (a policy's ``choose_tensors`` picks from them)."""
        matches = longest_matches(self._tokens, self._lengths, self.l_min, self.l_max, self.max_matches)
        cont = continuations(self._tokens, self._lengths, matches.ends, self.max_depth)
        return candidate_trees(cont, matches.length, self._kappa, floor)

    def candidate_trees(self, floor: float = 0.0) -> list[DraftTree]:
        if floor not in self._cached:
            self._cached[floor] = self.candidate_tensors(floor).to_trees()
        return self._cached[floor]

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        """The children of the frontier ``handles`` (nodes of this step's
        whole trees, -1: the root) on the device, ``max_matches`` wide (no
        node has more children than continuations): no value is read, so a
        layer loop over them (the hybrid's) runs at fixed shapes."""
        if self._whole is None:
            self._whole = self.candidate_tensors(0.0)
        return children(self._whole, handles, live, self.max_matches)


def children(trees: CandidateTrees, handles: torch.Tensor, live: torch.Tensor, width: int) -> Candidates:
    """Each live frontier node's children in ``trees`` (``handles`` [B, F]:
    node indices, -1 the root) as candidates ``[B, F, width]``: a node's
    children are consecutive in breadth-first order and by descending
    ``q``, so the first ``width`` of them in slot order are its first
    ``width`` children; empty slots hold token -1, ``q`` 0, handle -1."""
    batch, nodes = trees.tokens.shape
    slots = torch.arange(nodes, device=handles.device)
    real = slots.unsqueeze(0) < trees.num_nodes.unsqueeze(1)  # [B, N]
    kid = (trees.parents.unsqueeze(1) == handles.unsqueeze(2)) & real.unsqueeze(1) & live.unsqueeze(2)  # [B, F, N]
    rank = kid.long().cumsum(2) - 1
    place = torch.where(kid & (rank < width), rank, width)  # the rest into a spill column, cut off

    def laid_out(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((*handles.shape, width + 1), fill, dtype=values.dtype, device=values.device)
        return out.scatter_(2, place, values.unsqueeze(1).expand(-1, handles.shape[1], -1))[..., :width]

    return Candidates(laid_out(trees.tokens, PAD), laid_out(trees.q.float(), 0.0),
                      laid_out(slots.expand(batch, -1), ROOT))
