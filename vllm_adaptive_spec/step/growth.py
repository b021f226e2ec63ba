"""Growing draft trees layer by layer for a whole batch.

A drafter proposes, for every frontier node of every request, its candidate
children (top-``C`` tokens and draft probabilities, with an opaque *handle*
the drafter uses to expand that child later). A policy picks the next layer
among them, or stops. :func:`grow` runs that loop and returns one
:class:`~vllm_adaptive_spec.trees.tree.DraftTree` per request, breadth-first.

Every drafter can be grown layer by layer (``expand``); what more it can
do it declares as its :class:`Growth`, and a policy what it can choose from
(``TreePolicy.chooses_trees`` / ``chooses_tensors``); :func:`grow` takes the
path the two declare. Decision: a drafter whose candidates do not depend on
what is chosen (the retrieval trie is known before growth) hands over each
request's whole candidate tree (``candidate_trees``), and a policy whose
choice depends only on that tree (``choose``) picks from it in one pass: the
same trees as the layer loop (the tests compare them), without a round of
batched tensor operations per depth, which cost 13 ms a step at batch 16 (16
layers deep). Where the drafter has them as tensors on its device
(``candidate_tensors``) and the policy chooses over a batch of them
(``choose_tensors``), the choice runs there too and only the chosen nodes
are read back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from vllm_adaptive_spec.policies.base import TreePolicy
from vllm_adaptive_spec.trees.candidates import Candidates, Drafter, Growth, Layer
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree


@dataclass
class GrowthStats:
    draft_passes: int = 0


def grow(
    drafter: Drafter, policy: TreePolicy, max_nodes: torch.Tensor, max_depth: int, floor: float = 0.0
) -> tuple[list[DraftTree], GrowthStats]:
    """Grow one tree per request (``max_nodes`` [B] nodes at most each).
    ``floor``: a path probability below which the caller keeps no node (the
    load budget's); a whole-tree drafter leaves such nodes out."""
    batch = max_nodes.shape[0]
    whole = drafter.growth in (Growth.WHOLE_TREES, Growth.WHOLE_TENSORS)
    if drafter.growth is Growth.WHOLE_TENSORS and policy.chooses_tensors:
        candidates = drafter.candidate_tensors(max(policy.floor, floor))
        chosen = policy.choose_tensors(candidates, max_nodes.to(drafter.device), _largest(max_nodes))
        return chosen.to_trees(), GrowthStats()
    if whole and policy.chooses_trees:
        trees = drafter.candidate_trees(max(policy.floor, floor))
        return [policy.choose(tree, n) if n > 0 else DraftTree() for tree, n in zip(trees, max_nodes.tolist())], \
            GrowthStats()
    largest = _largest(max_nodes)
    max_depth = reachable_depth(policy, largest, max_depth)
    if drafter.growth is Growth.FIXED_LAYERS and max_depth > 0:
        fixed = grow_fixed(drafter, policy, max_nodes.to(drafter.device), max_depth, policy.layer_width(largest), floor)
        return fixed.to_trees(), GrowthStats(draft_passes=max_depth)
    layers = grow_layers(drafter, policy, max_nodes, max_depth, floor=floor)
    stats = GrowthStats(draft_passes=layers.passes)
    if layers.depth == 0:
        return [DraftTree() for _ in range(batch)], stats
    return assemble(layers, policy, max_nodes).to_trees(), stats


def reachable_depth(policy: TreePolicy, largest: int, max_depth: int) -> int:
    """The deepest layer :func:`grow` grows for trees of at most ``largest``
    nodes: the drafter's ``max_depth``, the policy's limit, and ``largest``
    itself (a kept tree is ancestor-closed, so no deeper than its size)."""
    return min(max_depth, policy.depth_limit(largest), largest)


def _largest(max_nodes: torch.Tensor) -> int:
    """The largest of the node limits ``max_nodes`` [B] (a host tensor), 0 for no request."""
    return int(max_nodes.max()) if max_nodes.shape[0] else 0


def grow_fixed(drafter: Drafter, policy: TreePolicy, max_nodes: torch.Tensor, depth: int, width: int,
               floor: float = 0.0) -> "GrownTrees":
    """Growth at fixed capacity: ``depth`` layers of
    ``width`` slots per request (``max_nodes`` [B] nodes each at most), the
    chosen candidates packed to the left and the rest invalid, layers past a
    request's last growing nothing, no value read back. The shapes depend on
    the batch, the width and the depth only, so the loop can be replayed from
    a graph. The trees equal :func:`grow`'s whenever no layer chose more than
    ``width`` candidates (the policy's ``layer_width``); beyond it a layer
    keeps its first ``width`` (by frontier, then candidate order), a tree cut
    to the capacity. :func:`grow` grows this way, on the drafter's
    ``device``, for a drafter of :class:`Growth` ``FIXED_LAYERS`` (a model
    drafter whose draft loop reads nothing back: ``step/draft_layers.FixedLayers``)."""
    return assemble(grow_layers(drafter, policy, max_nodes, depth, width, floor), policy, max_nodes)


def grow_layers(drafter: Drafter, policy: TreePolicy, max_nodes: torch.Tensor, depth: int, width: int | None = None,
                floor: float = 0.0):
    """Up to ``depth`` layers side by side (:class:`Layers`). ``width`` None:
    each layer as wide as its widest request's choice, and growth stops
    once no frontier is live (two host reads a layer); else ``width`` slots
    a layer and ``depth`` layers, with no value read (:func:`grow_fixed`).

    ``floor``: the load budget's path-probability floor. A frontier node
    below it is not expanded: the load budget keeps no node below the floor, and
    path probabilities only fall along a path, so none of its descendants
    could be kept either. This is what stops a confident-but-short tree's
    growth early (the draft passes it saves are most of a model drafter's
    cost), without changing the tree the load budget keeps (up to float rounding at the floor)."""
    batch, device = max_nodes.shape[0], max_nodes.device
    grown, size, offset = [], torch.zeros(batch, dtype=torch.long, device=device), 0
    handles = slot = torch.full((batch, 1), ROOT, dtype=torch.long, device=device)
    p = score = torch.ones(batch, 1, device=device)
    live = (max_nodes > 0).unsqueeze(1)
    passes = 0
    for index in range(depth):
        if not policy.grows_past_max_nodes:
            live = live & (size < max_nodes).unsqueeze(1)
        if width is None and not bool(live.any()):
            break
        candidates = drafter.expand(handles, live)
        passes += 1
        layer = Layer(candidates, torch.where(live, p, 0.0), index + 1, size, max_nodes, parent_score=score)
        chosen = (policy.select(layer) & (candidates.q > 0) & live.unsqueeze(-1)).flatten(1)
        layer_width = int(chosen.sum(1).max()) if width is None else width
        if layer_width == 0:
            break
        packed, handles, p = _packed(candidates, layer, chosen, slot, layer_width)
        grown.append(packed)
        size = size + packed.valid.sum(1)
        slot = torch.arange(offset, offset + layer_width, device=device).expand(batch, -1)
        offset += layer_width
        score, live = packed.score, packed.valid & ~layer.stop.unsqueeze(1)
        if floor > 0:
            live = live & (p >= floor)
    return _joined(grown, passes, batch, device)


def _packed(candidates: Candidates, layer: Layer, chosen: torch.Tensor, frontier_slot: torch.Tensor, width: int):
    """A layer's chosen candidates packed to the left of ``width`` slots per
    request (in frontier, then candidate order; beyond ``width``, cut), the
    rest invalid (``valid`` False; they hold whichever candidate the sort put
    there, and every reader masks by ``valid``); their handles and path
    probabilities (the next frontier's)."""
    if chosen.shape[1] == 1:  # one candidate a request (a chain's layer): already packed
        order, here = torch.zeros_like(chosen, dtype=torch.long), chosen
    else:
        ranked = torch.sort((~chosen).to(torch.int8), dim=1, stable=True)
        order, here = ranked.indices[:, :width], ranked.values[:, :width] == 0
    if order.shape[1] < width:  # a layer with fewer candidates than slots: pad with invalid slots
        order = torch.nn.functional.pad(order, (0, width - order.shape[1]))
        here = torch.nn.functional.pad(here, (0, width - here.shape[1]))
    p = layer.p.flatten(1).gather(1, order)
    score = p if layer.score is None else layer.score.flatten(1).gather(1, order)
    parent_slot = order // candidates.q.shape[-1]
    entropy = None if candidates.entropy is None else candidates.entropy.gather(1, parent_slot)
    packed = Layers(candidates.tokens.flatten(1).gather(1, order), frontier_slot.gather(1, parent_slot),
                    candidates.q.flatten(1).gather(1, order), score, entropy, here)
    handles = order if candidates.handles is None else candidates.handles.flatten(1).gather(1, order)
    return packed, handles, p


def _joined(grown: list, passes: int, batch: int, device: torch.device) -> "Layers":
    """The layers side by side, a slot each (``Layers.depth``: how many)."""
    if not grown:
        empty = torch.zeros(batch, 0, device=device)
        return Layers(empty.long(), empty.long(), empty, empty, None, empty.bool(), 0, passes)
    entropy = None if any(layer.entropy is None for layer in grown) else torch.cat([x.entropy for x in grown], 1)
    return Layers(*(torch.cat([getattr(x, name) for x in grown], 1) for name in ("tokens", "parents", "q", "score")),
                  entropy, torch.cat([x.valid for x in grown], 1), len(grown), passes)


class GrownTrees(NamedTuple):
    """Breadth-first trees ``[B, depth * width]``: ``tokens`` (-1 past a
    tree's nodes), ``parents``, ``q``, the parents' ``entropy`` (None where
    the drafter gives none) and ``num_nodes`` [B]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    q: torch.Tensor
    entropy: torch.Tensor | None
    num_nodes: torch.Tensor

    def to_trees(self) -> list[DraftTree]:
        """On the host, in one read (one synchronisation on a GPU, not one a
        field): the slots packed into one int64 copy, ``q``'s and the
        entropy's float64 bits as they are, then split there."""
        width = self.tokens.shape[1]
        floats = [self.q] if self.entropy is None else [self.q, self.entropy]
        packed = torch.cat([self.tokens, self.parents, self.num_nodes.unsqueeze(1),
                            *(x.double().view(torch.int64) for x in floats)], dim=1).cpu().numpy()
        tokens, parents, counts = packed[:, :width].tolist(), packed[:, width:2 * width].tolist(), packed[:, 2 * width]
        q = packed[:, 2 * width + 1:3 * width + 1].view(np.float64).tolist()
        entropy = packed[:, 3 * width + 1:].view(np.float64).tolist() if self.entropy is not None else None
        return [DraftTree(t[:n], r[:n], w[:n], entropy[b][:n] if entropy is not None else [])
                for b, (t, r, w, n) in enumerate(zip(tokens, parents, q, counts.tolist()))]


class Layers(NamedTuple):
    """Grown layers side by side, a slot each: a candidate chosen into a layer
    (``valid``) or an empty slot (its values undefined); ``parents`` name the parent's slot."""

    tokens: torch.Tensor  # [B, slots], layer after layer
    parents: torch.Tensor  # the parent's slot (-1: the root)
    q: torch.Tensor
    score: torch.Tensor
    entropy: torch.Tensor | None
    valid: torch.Tensor
    depth: int = 1  # layers grown
    passes: int = 0  # the drafter's expansions (draft passes)


def assemble(layers: Layers, policy: TreePolicy, max_nodes: torch.Tensor) -> GrownTrees:
    """The trees of ``depth`` grown layers: the nodes the policy keeps whose
    ancestors are kept (slot order is breadth-first, every parent before its
    children), renumbered, by tensor operations."""
    batch, total = layers.tokens.shape
    keep = policy.finish(layers.score, layers.valid, max_nodes) & layers.valid
    kept = keep.clone()
    for _ in range(layers.depth - 1):  # closed under ancestors: a round a layer
        parent_kept = torch.where(layers.parents >= 0, kept.gather(1, layers.parents.clamp(min=0)), True)
        kept = keep & parent_kept
    new_index = torch.cumsum(kept.long(), dim=1) - 1
    target = torch.where(kept, new_index, total)
    new_parent = torch.where(layers.parents >= 0, new_index.gather(1, layers.parents.clamp(min=0)), ROOT)

    def placed(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((batch, total + 1), fill, dtype=values.dtype, device=values.device)
        return out.scatter_(1, target, values)[:, :total]

    entropy = None if layers.entropy is None else placed(layers.entropy, 0.0)
    return GrownTrees(placed(layers.tokens, -1), placed(new_parent, ROOT), placed(layers.q, 0.0), entropy,
                      kept.sum(1))
