"""A model drafter's tree layer laid out at fixed capacity
(``draft_layer.lay_out_layer``): the same nodes, depths, ancestor sets,
positions and KV slots as feeding the live nodes one by one; traced whole by
``torch.compile(fullgraph=True)``; the same operations at every batch size
and frontier width, none reading a value back."""

from __future__ import annotations

import torch
from dispatched_ops import dispatched, reads

from vllm_adaptive_spec.trees.layer_layout import empty_state, lay_out_layer, node_slots

MAX_NODES = 24


def kv_slots(positions: torch.Tensor) -> torch.Tensor:
    return positions * 3 + 1  # any map of a request's draft-KV position to a cache slot


def random_layers(seed: int, batch: int, width: int, layers: int = 4):
    """Frontiers of ``layers`` layers: live slots and their parents (node
    ids already fed, or -1 at the first layer), capacities that cut some
    trees short."""
    gen = torch.Generator().manual_seed(seed)
    capacity = torch.randint(0, MAX_NODES + 1, (batch,), generator=gen)
    frontiers, fed = [], torch.zeros(batch, dtype=torch.long)
    for layer in range(layers):
        live = torch.rand(batch, width, generator=gen) < 0.7
        if layer == 0:
            parents = torch.full((batch, width), -1)
        else:
            parents = (torch.rand(batch, width, generator=gen) * fed.clamp(min=1).unsqueeze(1)).long()
            live &= (fed > 0).unsqueeze(1)
        frontiers.append((live, parents))
        fed = torch.minimum(fed + live.sum(1), capacity)
    root = torch.randint(5, 50, (batch,), generator=gen)
    context = torch.randint(10, 60, (batch,), generator=gen)
    return capacity, frontiers, root, context


def one_by_one(capacity, frontiers, root, context):
    """The reference: each tree's live slots fed in order while it has room."""
    batch, width = frontiers[0][0].shape
    depth = torch.zeros(batch, MAX_NODES, dtype=torch.long)
    ancestors = torch.zeros(batch, MAX_NODES, MAX_NODES, dtype=torch.bool)
    count = [0] * batch
    layers = []
    for live, parents in frontiers:
        node = torch.full((batch, width), -1)
        position, slot = torch.zeros(batch, width, dtype=torch.long), torch.full((batch, width), -1)
        visible = torch.zeros(batch, width, MAX_NODES, dtype=torch.bool)
        for b in range(batch):
            for f in range(width):
                if not live[b, f] or count[b] >= capacity[b]:
                    continue
                j, parent = count[b], int(parents[b, f])
                count[b] += 1
                depth[b, j] = 1 if parent < 0 else depth[b, parent] + 1
                if parent >= 0:
                    ancestors[b, j] = ancestors[b, parent]
                ancestors[b, j, j] = True
                node[b, f], position[b, f] = j, root[b] + depth[b, j]
                slot[b, f], visible[b, f] = kv_slots(context[b] + j), ancestors[b, j]
        layers.append((node, position, slot, visible))
    return layers


def laid_out(capacity, frontiers, root, context):
    state, slots = empty_state(capacity, MAX_NODES), node_slots(context, capacity, MAX_NODES, kv_slots)
    layers = []
    for live, parents in frontiers:
        state, rows = lay_out_layer(state, live, parents, root, slots)
        fed_position = torch.where(rows.fed, rows.position, 0)
        layers.append((rows.node, fed_position, rows.slot, rows.visible))
    return layers


def test_the_layout_equals_feeding_node_by_node():
    for seed in range(20):
        inputs = random_layers(seed, batch=6, width=8)
        for got, want in zip(laid_out(*inputs), one_by_one(*inputs)):
            for g, w in zip(got, want):
                assert torch.equal(g, w), seed


def test_a_layer_compiles_whole_and_equals_eager():
    torch._dynamo.reset()
    capacity, frontiers, root, context = random_layers(3, batch=4, width=8)
    state, slots = empty_state(capacity, MAX_NODES), node_slots(context, capacity, MAX_NODES, kv_slots)
    state, _ = lay_out_layer(state, *frontiers[0], root, slots)
    compiled = torch.compile(lay_out_layer, fullgraph=True, dynamic=False, backend="aot_eager")
    eager = lay_out_layer(state, *frontiers[1], root, slots)
    traced = compiled(state, *frontiers[1], root, slots)
    for got, want in zip([*traced[0], *traced[1]], [*eager[0], *eager[1]]):
        assert torch.equal(got, want)
    assert eager[1].fed.any()


def test_the_same_operations_at_every_batch_and_width():
    """No loop over requests or nodes, and no value read back."""
    counts = []
    for batch, width in ((8, 4), (64, 4), (8, 16), (64, 16)):
        capacity, frontiers, root, context = random_layers(batch + width, batch, width)
        state, slots = empty_state(capacity, MAX_NODES), node_slots(context, capacity, MAX_NODES, kv_slots)
        counts.append(dispatched(lay_out_layer, state, *frontiers[0], root, slots))
        counts.append(dispatched(node_slots, context, capacity, MAX_NODES, kv_slots))
    assert all(ops == counts[k % 2] for k, ops in enumerate(counts))
    assert not reads(counts[0]) and not reads(counts[1])
