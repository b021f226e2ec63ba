"""One tree layer of a model drafter, laid out at fixed capacity: which frontier nodes are fed, their node ids, depths, ancestor
sets, positions and draft-KV slots, as tensor operations over ``[B, F]``
(``B`` trees, ``F`` frontier slots) with no value read back, so the layout
of every layer can be traced whole and replayed from a graph.

The trees' scratch has ``N`` node columns, a spill column (index ``N``)
and a root column (index ``N + 1``). An unfed frontier slot writes its
depth and ancestor row into the spill, so every scatter has the same shape
whatever the layer fed; the root's column is never written (depth 0, no
ancestors), so a child of the root reads its parent's depth, ancestors and
(an EAGLE-3 head's) hidden state as any other node does. Node ``j`` of a
tree sits at position ``root + depth(j)`` and writes its draft KV at slot
``C + j`` after the request's committed draft context ``C`` (the engine
reserves those slots), looked up in ``node_slots`` [B, N + 1], which the
backend computes once a step (its spill column ``-1``: an unfed slot writes
no KV).
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TreeState(NamedTuple):
    """The trees grown so far: nodes fed per tree ``count`` [B], the most
    each may feed ``capacity`` [B] (its KV scratch), each node's ``depth``
    [B, N + 2] and ancestor-or-self set ``ancestors`` [B, N + 2, N + 2]
    (bool; the last two columns: the spill, the root)."""

    count: torch.Tensor
    capacity: torch.Tensor
    depth: torch.Tensor
    ancestors: torch.Tensor


class LayerRows(NamedTuple):
    """One layer's frontier slots ``[B, F]``: whether each is ``fed``, its
    node id ``node`` (``-1`` unfed) and scratch ``column`` (the spill
    column ``N`` unfed), its parent's column ``parent_column`` (the
    root's, ``N + 1``, for the root's children), its ``position``, its
    draft-KV ``slot`` (``-1`` unfed) and ``visible`` [B, F, N]: the tree
    nodes it attends to (itself and its ancestors)."""

    fed: torch.Tensor
    node: torch.Tensor
    column: torch.Tensor
    parent_column: torch.Tensor
    position: torch.Tensor
    slot: torch.Tensor
    visible: torch.Tensor


def node_slots(context: torch.Tensor, capacity: torch.Tensor, max_nodes: int, kv_slots) -> torch.Tensor:
    """[B, N + 1] the cache slot of each node id's draft KV: node ``j`` at
    draft-KV position ``C + j`` (``context`` [B]) where ``j`` is below the
    tree's ``capacity`` [B], else ``-1`` (the spill column always);
    ``kv_slots(positions [B, N + 1]) -> [B, N + 1]`` maps positions within
    a request's reserved blocks to slots. Once a step, not once a layer."""
    ids = torch.arange(max_nodes + 1, device=capacity.device)
    inside = ids < capacity.unsqueeze(1)
    last = (capacity - 1).clamp(min=0).unsqueeze(1)
    slots = kv_slots(context.unsqueeze(1) + torch.minimum(ids, last))
    return torch.where(inside, slots.to(capacity.device), -1)


def empty_state(capacity: torch.Tensor, max_nodes: int) -> TreeState:
    """Trees with no node yet, ``capacity`` [B] nodes each at most."""
    batch = capacity.shape[0]
    return TreeState(
        torch.zeros(batch, dtype=torch.long, device=capacity.device),
        capacity,
        torch.zeros(batch, max_nodes + 2, dtype=torch.long, device=capacity.device),
        torch.zeros(batch, max_nodes + 2, max_nodes + 2, dtype=torch.bool, device=capacity.device),
    )


def lay_out_layer(state: TreeState, live: torch.Tensor, parents: torch.Tensor, root_position: torch.Tensor,
                  node_slots: torch.Tensor) -> tuple[TreeState, LayerRows]:
    """Feed the ``live`` frontier slots [B, F] whose ``parents`` [B, F] are
    node ids (``-1``: the root), in frontier order, while the tree has room:
    the trees after the layer and the layer's rows. ``root_position`` [B]:
    each request's root position; ``node_slots`` [B, N + 1]: the cache slot
    of each node id's draft KV (``-1`` in the spill column)."""
    batch, width = live.shape
    spill = state.depth.shape[1] - 2
    root = spill + 1
    ids = torch.cumsum(live, dim=1) + (state.count - 1).unsqueeze(1)  # int64: the count of live slots so far
    fed = live & (ids < state.capacity.unsqueeze(1))
    node = torch.where(fed, ids, spill)
    parent_column = torch.where(parents >= 0, parents, root)
    depth = state.depth.gather(1, parent_column) + 1
    lineage = state.ancestors.gather(1, parent_column.unsqueeze(-1).expand(batch, width, root + 1))
    lineage = lineage.scatter_(2, node.unsqueeze(-1), True)  # and itself
    after = TreeState(
        state.count + fed.sum(1),
        state.capacity,
        state.depth.scatter(1, node, depth),
        state.ancestors.scatter(1, node.unsqueeze(-1).expand(batch, width, root + 1), lineage),
    )
    rows = LayerRows(
        fed=fed,
        node=torch.where(fed, ids, -1),
        column=node,
        parent_column=parent_column,
        position=root_position.unsqueeze(1) + depth,
        slot=node_slots.gather(1, node),
        visible=lineage[..., :spill] & fed.unsqueeze(-1),
    )
    return after, rows
