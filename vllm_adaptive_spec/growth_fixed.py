"""Tree growth at fixed capacity (issue 53, item 2): the layer loop of
:func:`~vllm_adaptive_spec.growth.grow` with a fixed frontier width and a
fixed number of layers, and no value read back inside it.

:func:`grow` sizes each layer by its largest request (``int(count.max())``)
and stops when no frontier is live (``bool(any())``): two host reads per
layer, which on a GPU wait for the draft model's pass. Here every layer has
``width`` slots per request (the policy's :meth:`layer_width`), its chosen
candidates packed to the left and the rest invalid; layers past a request's
last grow nothing; the trees are assembled from the layers by tensor
operations (the kept nodes closed under ancestors, renumbered breadth-first).
The shapes depend on the batch, the width and the depth only, so the loop
can be replayed from a graph. The trees equal :func:`grow`'s whenever no
layer chose more than ``width`` candidates (``tests/test_growth_fixed.py``);
beyond it a layer keeps its first ``width`` (by frontier, then candidate
order), a tree cut to the capacity.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_adaptive_spec.growth import Drafter, Layer, Policy
from vllm_adaptive_spec.tree import ROOT, DraftTree


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
        """On the host, in one read."""
        rows = [x.tolist() for x in (self.tokens, self.parents, self.q, self.num_nodes)]
        entropy = self.entropy.tolist() if self.entropy is not None else None
        return [DraftTree(t[:n], r[:n], w[:n], entropy[b][:n] if entropy is not None else [])
                for b, (t, r, w, n) in enumerate(zip(*rows))]


class _Layers(NamedTuple):
    tokens: torch.Tensor  # [B, L * W], layer after layer
    parents: torch.Tensor  # slot of the parent (-1: the root)
    q: torch.Tensor
    score: torch.Tensor
    entropy: torch.Tensor | None
    valid: torch.Tensor


def grow_fixed(drafter: Drafter, policy: Policy, budget: torch.Tensor, depth: int, width: int) -> GrownTrees:
    """``depth`` layers of ``width`` slots per request (``budget`` [B] nodes each at most)."""
    return _assemble(_grow_layers(drafter, policy, budget, depth, width), policy, budget, depth)


def _grow_layers(drafter: Drafter, policy: Policy, budget: torch.Tensor, depth: int, width: int) -> _Layers:
    batch = budget.shape[0]
    slots = torch.arange(width).unsqueeze(0)
    tokens, parents, q, score, entropy, valid = [], [], [], [], [], []
    size = torch.zeros(batch, dtype=torch.long)
    handles = torch.full((batch, 1), ROOT, dtype=torch.long)
    frontier_slot = torch.full((batch, 1), ROOT, dtype=torch.long)
    frontier_p, frontier_score = torch.ones(batch, 1), torch.ones(batch, 1)
    live = (budget > 0).unsqueeze(1)
    for layer_index in range(depth):
        if not policy.grows_past_budget:
            live = live & (size < budget).unsqueeze(1)
        candidates = drafter.expand(handles, live)
        layer = Layer(candidates, torch.where(live, frontier_p, 0.0), layer_index + 1, size.clone(), budget,
                      parent_score=frontier_score)
        chosen = (policy.select(layer) & (candidates.q > 0) & live.unsqueeze(-1)).flatten(1)
        count = chosen.sum(1).clamp(max=width)
        order = torch.sort((~chosen).to(torch.int8), dim=1, stable=True).indices[:, :width]
        if order.shape[1] < width:  # a frontier narrower than the width: pad with its first slot
            order = torch.nn.functional.pad(order, (0, width - order.shape[1]))
        here = slots < count.unsqueeze(1)
        parent_slot = order // candidates.q.shape[-1]
        p = layer.p.flatten(1).gather(1, order)
        tokens.append(torch.where(here, candidates.tokens.flatten(1).gather(1, order), -1))
        parents.append(torch.where(here, frontier_slot.gather(1, parent_slot), ROOT))
        q.append(torch.where(here, candidates.q.flatten(1).gather(1, order), 0.0))
        score.append(torch.where(here, p if layer.score is None else layer.score.flatten(1).gather(1, order), 0.0))
        if candidates.entropy is not None:
            entropy.append(candidates.entropy.gather(1, parent_slot))
        valid.append(here)
        size = size + count
        handles = candidates.handles.flatten(1).gather(1, order)
        frontier_slot = layer_index * width + slots.expand(batch, -1)
        frontier_p, frontier_score, live = torch.where(here, p, 0.0), score[-1], here & ~layer.stop.unsqueeze(1)
    return _Layers(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(q, 1), torch.cat(score, 1),
                   torch.cat(entropy, 1) if len(entropy) == depth else None, torch.cat(valid, 1))


def _assemble(layers: _Layers, policy: Policy, budget: torch.Tensor, depth: int) -> GrownTrees:
    """The nodes the policy keeps whose parent is kept (slot order is
    breadth-first, every parent before its children), renumbered."""
    batch, total = layers.tokens.shape
    keep = policy.finish(layers.score, layers.valid, budget) & layers.valid
    kept = keep.clone()
    for _ in range(depth - 1):  # closed under ancestors: a round a layer
        parent_kept = torch.where(layers.parents >= 0, kept.gather(1, layers.parents.clamp(min=0)), True)
        kept = keep & parent_kept
    new_index = torch.cumsum(kept.long(), dim=1) - 1
    target = torch.where(kept, new_index, total)
    new_parent = torch.where(layers.parents >= 0, new_index.gather(1, layers.parents.clamp(min=0)), ROOT)

    def placed(values: torch.Tensor, fill) -> torch.Tensor:
        out = torch.full((batch, total + 1), fill, dtype=values.dtype)
        return out.scatter_(1, target, values)[:, :total]

    entropy = None if layers.entropy is None else placed(layers.entropy, 0.0)
    return GrownTrees(placed(layers.tokens, -1), placed(new_parent, ROOT), placed(layers.q, 0.0), entropy,
                      kept.sum(1))
