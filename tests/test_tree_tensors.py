"""The uniform step's device part, from the persistent tree buffers: the
layout (``tree_step.uniform_layout``), the acceptance and the KV moves. Equal to
the reference path on random trees, ties included; traced whole by
``torch.compile(fullgraph=True)`` (no host read, no data-dependent shape);
the same torch operations whatever the batch and the width."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import dispatched_ops
import pytest
import torch
from test_tree import random_bfs_tree
from test_tree_buffers import reference_tensors

from vllm_adaptive_spec.step.tree_step import uniform_layout
from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch
from vllm_adaptive_spec.trees.tree_buffers import TreeBuffers
from vllm_adaptive_spec.trees.tree_tensors import row_visibility
from vllm_adaptive_spec.trees.verify import accept, path_moves

VOCAB = 6  # small, so that drafts match their targets often and ties are common


def tied_tree(rng: random.Random, n: int) -> DraftTree:
    """A random tree whose ``q`` take few values, so path probabilities tie."""
    tree = random_bfs_tree(rng, n, vocab=VOCAB + 4)
    tree.tokens = [t % VOCAB if rng.random() < 0.8 else t for t in tree.tokens]
    seen, tokens = set(), []
    for parent, token in zip(tree.parents, tree.tokens):  # siblings stay distinct
        while (parent, token) in seen:
            token += VOCAB
        seen.add((parent, token))
        tokens.append(token)
    return DraftTree(tokens, tree.parents, [rng.choice([1.0, 0.5, 0.25]) for _ in tokens])


def random_step(seed: int, batch: int, width: int):
    rng = random.Random(seed)
    trees = [tied_tree(rng, rng.randint(0, width)) for _ in range(batch)]
    gen = torch.Generator().manual_seed(seed)
    # Rows of every slot ``buffered`` writes to, each with argmax ties.
    logits = torch.randint(0, 3, ((batch + 3) * (1 + width), VOCAB), generator=gen).float()
    return trees, logits


def buffered(trees: list[DraftTree], width: int) -> tuple[TreeBuffers, torch.Tensor]:
    """The trees in persistent buffers wider than the step, in slots that
    are not their batch order (vLLM's reordering: the index map)."""
    buffers = TreeBuffers(len(trees) + 3, width + 5, torch.device("cpu"))
    return buffers, buffers.write(buffers.host_rows(list(range(len(trees) + 2, 2, -1)), trees))


def device_step(buffers: TreeBuffers, slots: torch.Tensor, width: int, logits: torch.Tensor):
    """What a uniform step runs on the device: its trees read from the
    buffers, its layout, the greedy acceptance of each row's target and the
    accepted nodes' KV moves."""
    layout = uniform_layout(buffers.read(slots, width), slots)
    targets = logits.argmax(dim=-1)[layout.query_rows].view(-1, width + 1)
    acceptance = accept(layout.tree.batch, targets, layout.tree.ancestors)
    return layout, acceptance, path_moves(acceptance, layout.root_rows + 1)


def test_the_layout_matches_the_reference_masks_and_depths():
    trees, logits = random_step(1, 16, 8)
    buffers, slots = buffered(trees, 8)
    layout = uniform_layout(buffers.read(slots, 8), slots)
    tree = layout.tree
    visibility = row_visibility(tree)
    reference = TreeBatch.from_trees(trees, 8).row_mask()
    valid = torch.nn.functional.pad(tree.valid(), (1, 0), value=True)
    seen = valid.unsqueeze(1) & valid.unsqueeze(2)
    assert torch.equal(visibility & seen, reference & seen)
    one_hot = torch.nn.functional.one_hot(torch.zeros((~valid).sum(), dtype=torch.long), 9).bool()
    assert torch.equal(visibility[~valid], one_hot)  # a padding row sees the root only
    assert not (visibility & ~valid.unsqueeze(1)).any()  # nobody sees a padding row
    offsets = layout.node_offsets.view(16, 8)
    for b, t in enumerate(trees):  # node i sits at its root's position plus its depth
        assert [i + 1 + int(offsets[b, i]) for i in range(len(t))] == t.depths()
    assert layout.root_rows.tolist() == (slots * 9).tolist()


@pytest.mark.parametrize("batch, width", [(8, 4), (5, 16)])
def test_the_device_step_compiles_whole_and_equals_eager(batch, width):
    torch._dynamo.reset()
    trees, logits = random_step(2, batch, width)
    buffers, slots = buffered(trees, width)
    compiled = torch.compile(device_step, fullgraph=True, dynamic=False, backend="aot_eager")
    eager = device_step(buffers, slots, width, logits)
    traced = compiled(buffers, slots, width, logits)
    assert len(leaves(traced)) == len(leaves(eager)) == 16
    for got, want in zip(leaves(traced), leaves(eager)):
        assert torch.equal(got, want)
    # And equal to the reference acceptance of the same rows' targets.
    targets = logits.argmax(-1)[traced[0].query_rows].view(batch, width + 1)
    reference = accept(TreeBatch.from_trees(trees, width), targets)
    assert torch.equal(traced[1].output_tokens, reference.output_tokens)
    assert reference.num_accepted.sum() > 0  # the ties and the small vocabulary make matches


def leaves(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if dataclasses.is_dataclass(value):
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    return [leaf for item in value for leaf in leaves(item)]


def dispatched(batch: int, width: int) -> Counter:
    trees, logits = random_step(4, batch, width)
    buffers, slots = buffered(trees, width)
    return dispatched_ops.dispatched(device_step, buffers, slots, width, logits)


def test_the_same_operations_at_every_batch_and_width():
    """No loop over requests or nodes: the operations dispatched are the
    same at batch 8 and 64 and at width 4 and 16, and none reads a value
    back (``aten._local_scalar_dense`` is what ``item``/``bool``/``int`` dispatch)."""
    counts = [dispatched(batch, width) for batch in (8, 64) for width in (4, 16)]
    assert all(count == counts[0] for count in counts)
    assert not dispatched_ops.reads(counts[0])
