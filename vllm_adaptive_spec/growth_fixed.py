"""Tree growth at fixed capacity (issue 53, item 2): the layer loop of
:func:`~vllm_adaptive_spec.growth.grow` (``grow_layers``) with a fixed
frontier width and a fixed number of layers, and no value read back inside it.

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

from vllm_adaptive_spec.growth import Drafter, GrownTrees, Policy, assemble, grow_layers


def grow_fixed(drafter: Drafter, policy: Policy, budget: torch.Tensor, depth: int, width: int) -> GrownTrees:
    """``depth`` layers of ``width`` slots per request (``budget`` [B] nodes each at most)."""
    return assemble(grow_layers(drafter, policy, budget, depth, width), policy, budget)
