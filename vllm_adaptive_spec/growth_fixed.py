"""Tree growth at fixed capacity (issue 53, item 2): the layer loop of
:func:`~vllm_adaptive_spec.growth.grow` with a fixed frontier width and a
fixed number of layers, and no value read back inside it.

:func:`grow` sizes each layer by its largest request (``int(count.max())``)
and stops when no frontier is live (``bool(any())``): two host reads per
layer, which on a GPU wait for the draft model's pass. Here every layer has
``width`` slots per request (the policy's :meth:`layer_width`), its chosen
candidates packed to the left and the rest invalid; layers past a request's
last grow nothing; the trees are assembled from the layers by tensor
operations (``growth.assemble``).
The shapes depend on the batch, the width and the depth only, so the loop
can be replayed from a graph. The trees equal :func:`grow`'s whenever no
layer chose more than ``width`` candidates (``tests/test_growth_fixed.py``);
beyond it a layer keeps its first ``width`` (by frontier, then candidate
order), a tree cut to the capacity.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.growth import Drafter, GrownTrees, Layer, Layers, Policy, assemble
from vllm_adaptive_spec.tree import ROOT


def grow_fixed(drafter: Drafter, policy: Policy, budget: torch.Tensor, depth: int, width: int) -> GrownTrees:
    """``depth`` layers of ``width`` slots per request (``budget`` [B] nodes each at most)."""
    return assemble(_grow_layers(drafter, policy, budget, depth, width), policy, budget, depth)


def _grow_layers(drafter: Drafter, policy: Policy, budget: torch.Tensor, depth: int, width: int) -> Layers:
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
    return Layers(torch.cat(tokens, 1), torch.cat(parents, 1), torch.cat(q, 1), torch.cat(score, 1),
                   torch.cat(entropy, 1) if len(entropy) == depth else None, torch.cat(valid, 1))
