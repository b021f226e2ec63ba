"""The persistent tree buffers: ancestor bitmasks that
round-trip, trees that read back as written whatever was in their rows, and
a uniform step laid out from them exactly as the ragged layout lays it out."""

from __future__ import annotations

import random

import torch
from test_tree import random_bfs_tree

from vllm_adaptive_spec.step.tree_step import build_step, build_uniform_step
from vllm_adaptive_spec.trees.tree import DraftTree, HostTrees
from vllm_adaptive_spec.trees.tree_buffers import TreeBuffers, num_words, pack_bits, unpack_bits
from vllm_adaptive_spec.trees.tree_tensors import TreeTensors

CPU = torch.device("cpu")


def reference_tensors(trees: list[DraftTree], width: int) -> TreeTensors:
    """The trees at ``width`` node slots, from the host layout (``HostTrees``)."""
    host = HostTrees.of(trees, width)
    parts = (host.tokens, host.parents, host.depths(), host.num_nodes, host.ancestors)
    return TreeTensors(*(torch.from_numpy(x) for x in parts))


def test_bitmasks_round_trip_across_words_and_the_sign_bit():
    gen = torch.Generator().manual_seed(0)
    mask = torch.rand(3, 70, 70, generator=gen) < 0.5
    mask[0, 0, 63] = True  # the sign bit of the first word
    bits = pack_bits(mask, num_words(70))
    assert bits.shape == (3, 70, 2) and bits.dtype == torch.int64 and (bits < 0).any()
    assert torch.equal(unpack_bits(bits, 70), mask)
    assert num_words(64) == 1 and num_words(65) == 2


def test_trees_read_back_as_written_in_any_slot_order():
    rng = random.Random(1)
    buffers = TreeBuffers(max_reqs=8, capacity=16, device=CPU)
    for _ in range(3):  # later steps write smaller trees over larger ones
        slots = rng.sample(range(8), 5)
        trees = [random_bfs_tree(rng, rng.randint(0, 8)) for _ in slots]
        index = buffers.write(buffers.host_rows(slots, trees))
        assert index.tolist() == slots
        for got, want in zip(buffers.read(index, 8), reference_tensors(trees, 8)):
            assert torch.equal(got, want)
        assert (buffers.tokens[index, 8:] == -1).all() and not buffers.bits[index, 8:].any()


def test_a_uniform_step_from_the_buffers_is_the_ragged_layout_of_that_step():
    """Every decoding request has ``rows`` rows (root, nodes, padding);
    requests 1 and 4 carry no tree (vLLM's placeholders)."""
    rng = random.Random(2)
    rows, num_reqs = 9, 6
    slots = [0, 2, 3, 5]
    trees = [random_bfs_tree(rng, n) for n in (8, 3, 0, 5)]
    trees[2] = DraftTree.chain([4])
    buffers = TreeBuffers(max_reqs=num_reqs, capacity=16, device=CPU)
    uniform = build_uniform_step(slots, trees, rows, buffers, CPU)
    ragged = build_step(slots, trees, [s * rows for s in slots], [rows] * len(slots), CPU,
                        [rows - 1 - len(t) for t in trees])
    for field in ("query_rows", "query_start_loc", "query_mask", "root_rows", "batch_indices"):
        assert torch.equal(getattr(uniform, field), getattr(ragged, field)), field
    assert (uniform.host_first_rows, uniform.host_root_rows) == (ragged.host_first_rows, ragged.host_root_rows)
    positions = [torch.arange(num_reqs * rows) for _ in range(2)]
    for step, position in zip((uniform, ragged), positions):
        position[step.node_rows] += step.node_offsets
    assert torch.equal(*positions)
    width = ragged.tree_batch.width
    assert torch.equal(uniform.tree_batch.tokens[:, :width], ragged.tree_batch.tokens)
    assert torch.equal(uniform.tree_batch.parents[:, :width], ragged.tree_batch.parents)
    assert torch.equal(uniform.tree_batch.num_nodes, ragged.tree_batch.num_nodes)
    assert torch.equal(uniform.ancestors[:, :width, :width], ragged.ancestors)
    assert not uniform.ancestors[:, width:].any() and (uniform.tree_batch.tokens[:, width:] == -1).all()
