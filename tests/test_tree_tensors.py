"""The step's device part at fixed capacity (issue 52), from the persistent
tree buffers: equal to the reference path on random trees, ties included; traced whole by
``torch.compile(fullgraph=True)`` (no host read, no data-dependent shape);
the same torch operations whatever the batch and the width."""

from __future__ import annotations

import dataclasses
import random
from collections import Counter

import pytest
import dispatched_ops
import torch
from test_tree import random_bfs_tree
from test_verify import naive_accept

from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch
from vllm_adaptive_spec.trees.tree_buffers import TreeBuffers
from vllm_adaptive_spec.trees.tree_tensors import (
    TreeTensors,
    greedy_targets,
    row_positions,
    row_visibility,
    sampled_targets,
    select_within_width,
    verify_step,
)
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
    logits = torch.randint(0, 3, (batch * (1 + width), VOCAB), generator=gen).float()  # argmax ties
    base = torch.randint(5, 50, (batch,), generator=gen)
    return trees, TreeTensors.from_trees(trees, width), logits, base


def buffered(trees: list[DraftTree], width: int) -> tuple[TreeBuffers, torch.Tensor]:
    """The trees in persistent buffers wider than the step, in slots that
    are not their batch order (vLLM's reordering: the index map)."""
    buffers = TreeBuffers(len(trees) + 3, width + 5, torch.device("cpu"))
    return buffers, buffers.write(buffers.host_rows(list(range(len(trees) + 2, 2, -1)), trees))


def device_step(buffers: TreeBuffers, slots: torch.Tensor, width: int, base: torch.Tensor, logits: torch.Tensor,
                noise: torch.Tensor, max_drafts: int):
    """The step's device part: the trees read from the buffers, layout,
    greedy and sampled acceptance, the output and the KV moves, and a
    selection within half the width."""
    tree = buffers.read(slots, width)
    batch = tree.tokens.shape[0]
    first_rows = torch.arange(batch, device=base.device) * (1 + width) + 1
    greedy = verify_step(tree, greedy_targets(logits, batch), first_rows, max_drafts)
    sampled = verify_step(tree, sampled_targets(logits.softmax(-1), noise, batch), first_rows, max_drafts)
    path_p = tree.depth.float().neg().exp()  # ties within a depth
    chosen = select_within_width(tree.tokens, tree.parents, path_p, tree.num_nodes, tree.ancestors, max(1, width // 2))
    return row_positions(base, tree), row_visibility(tree), greedy, sampled, chosen


def test_select_within_width_keeps_what_keep_best_keeps():
    rng = random.Random(0)
    for _ in range(200):
        capacity, width = rng.randint(1, 12), rng.randint(1, 12)
        trees = [tied_tree(rng, rng.randint(0, capacity)) for _ in range(4)]
        candidates = TreeTensors.from_trees(trees, capacity)
        path_p = torch.zeros(4, capacity)
        for b, tree in enumerate(trees):
            path_p[b, : len(tree)] = torch.tensor(tree.path_probabilities())
        chosen = select_within_width(candidates.tokens, candidates.parents, path_p, candidates.num_nodes,
                                     candidates.ancestors, width)
        expected = TreeTensors.from_trees([tree.keep_best(width) for tree in trees], width)
        for got, want in zip(chosen, expected):
            assert torch.equal(got, want)


def test_layout_matches_the_reference_masks_and_depths():
    trees, tree, _, base = random_step(1, 16, 8)
    visibility = row_visibility(tree)
    reference = TreeBatch.from_trees(trees, 8).row_mask()
    valid = torch.nn.functional.pad(tree.valid(), (1, 0), value=True)
    seen = valid.unsqueeze(1) & valid.unsqueeze(2)
    assert torch.equal(visibility & seen, reference & seen)
    assert torch.equal(visibility[~valid], torch.nn.functional.one_hot(torch.zeros((~valid).sum(), dtype=torch.long), 9).bool())
    assert not (visibility & ~valid.unsqueeze(1)).any()  # nobody sees a padding row
    positions = row_positions(base, tree)
    for b, t in enumerate(trees):
        assert positions[b, : 1 + len(t)].tolist() == [int(base[b]) + d for d in [0, *t.depths()]]


@pytest.mark.parametrize("seed", range(5))
def test_verify_step_equals_the_naive_walk(seed):
    width, max_drafts = 7, 9
    trees, tree, logits, _ = random_step(seed, 12, width)
    targets = greedy_targets(logits, 12)
    first_rows = torch.arange(12) * (1 + width) + 1
    out = verify_step(tree, targets, first_rows, max_drafts)
    for b, t in enumerate(trees):
        path, tokens = naive_accept(t, targets[b].tolist(), width)
        assert out.acceptance.path[b, : len(path)].tolist() == path
        assert out.sampled[b].tolist() == tokens + [-1] * (max_drafts - width)
    src, dst = path_moves(out.acceptance, first_rows)
    assert torch.equal(out.src_rows, src) and torch.equal(out.dst_rows, dst)
    assert out.acceptance.num_accepted.sum() > 0  # the ties and the small vocabulary make matches


@pytest.mark.parametrize("batch, width", [(8, 4), (5, 16)])
def test_the_device_step_compiles_whole_and_equals_eager(batch, width):
    torch._dynamo.reset()
    trees, tree, logits, base = random_step(2, batch, width)
    buffers, slots = buffered(trees, width)
    noise = torch.empty_like(logits).exponential_(generator=torch.Generator().manual_seed(3))
    compiled = torch.compile(device_step, fullgraph=True, dynamic=False, backend="aot_eager")
    eager = device_step(buffers, slots, width, base, logits, noise, width + 2)
    traced = compiled(buffers, slots, width, base, logits, noise, width + 2)
    assert len(leaves(traced)) == len(leaves(eager)) == 19
    for got, want in zip(leaves(traced), leaves(eager)):
        assert torch.equal(got, want)
    # And equal to the reference acceptance on the same targets.
    reference = accept(TreeBatch.from_trees(trees, width), greedy_targets(logits, batch))
    assert torch.equal(traced[2].acceptance.output_tokens, reference.output_tokens)


def leaves(value) -> list[torch.Tensor]:
    if torch.is_tensor(value):
        return [value]
    if dataclasses.is_dataclass(value):
        value = [getattr(value, field.name) for field in dataclasses.fields(value)]
    return [leaf for item in value for leaf in leaves(item)]


def dispatched(batch: int, width: int) -> Counter:
    trees, _, logits, base = random_step(4, batch, width)
    buffers, slots = buffered(trees, width)
    noise = torch.ones_like(logits)
    return dispatched_ops.dispatched(device_step, buffers, slots, width, base, logits, noise, width)


def test_the_same_operations_at_every_batch_and_width():
    """No loop over requests or nodes: the operations dispatched are the
    same at batch 8 and 64 and at width 4 and 16, and none reads a value
    back (``aten._local_scalar_dense`` is what ``item``/``bool``/``int`` dispatch)."""
    counts = [dispatched(batch, width) for batch in (8, 64) for width in (4, 16)]
    assert all(count == counts[0] for count in counts)
    assert not dispatched_ops.reads(counts[0])
