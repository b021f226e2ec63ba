"""The per-step layout of trees in vLLM's flattened batch (no engine)."""

import torch

from vllm_adaptive_spec.step.tree_step import build_step
from vllm_adaptive_spec.trees.tree import DraftTree


def rows_repositioned(step, num_rows: int) -> list[int]:
    """Sequential positions of ``num_rows`` batch rows, moved as the runner
    moves them (``_set_depth_positions``)."""
    positions = torch.arange(num_rows)
    positions[step.node_rows] += step.node_offsets
    return positions.tolist()


def test_layout_of_two_trees_after_a_prefill_chunk():
    # Batch rows: request 0 = a 3-token prefill chunk (no tree, rows 0-2);
    # request 1 = root + tree of 3 (rows 3-6); request 2 = root + chain of 2 (rows 7-9).
    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0], q=[0.6, 0.4, 1.0])
    chain = DraftTree.chain([8, 9])
    step = build_step([1, 2], [tree, chain], [3, 7], [4, 3], torch.device("cpu"))

    assert step.batch_indices.tolist() == [1, 2]
    assert step.query_rows.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert step.query_start_loc.tolist() == [0, 4, 7]
    assert step.ancestors.sum(-1).tolist() == [[1, 1, 2], [1, 2, 0]]
    # On the host: node rows and their offsets to position p0 + depth
    # (request 1's nodes sit at depths 1, 1, 2 in rows 4-6; request 2's at 1, 2 in rows 8-9).
    assert step.node_rows.tolist() == [4, 5, 6, 8, 9]
    assert step.node_offsets.tolist() == [0, -1, -1, 0, 0]
    assert (step.host_batch_indices, step.host_first_rows, step.host_root_rows) == ([1, 2], [3, 7], [3, 7])
    assert step.root_rows.tolist() == [3, 7]
    assert rows_repositioned(step, 10) == [0, 1, 2, 3, 4, 4, 5, 7, 8, 9]
    expected = torch.tensor(
        [
            [1, 0, 0, 0],  # root of request 1
            [1, 1, 0, 0],  # node 0
            [1, 0, 1, 0],  # node 1: not its sibling
            [1, 1, 0, 1],  # node 2: root, its parent node 0, itself
            [1, 0, 0, 0],  # root of request 2
            [1, 1, 0, 0],
            [1, 1, 1, 0],
        ],
        dtype=torch.bool,
    )
    assert torch.equal(step.query_mask, expected)


def test_rows_before_the_root_stay_causal():
    step = build_step([0], [DraftTree.chain([4])], [0], [3], torch.device("cpu"))
    # Two earlier rows (e.g. a resumed request), then root and one node.
    assert step.query_mask.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    assert step.causal  # a chain: vLLM's causal kernel serves it


def test_a_branching_tree_is_not_causal():
    tree = DraftTree(tokens=[5, 6], parents=[-1, -1], q=[0.6, 0.4])
    step = build_step([0, 1], [DraftTree.chain([3, 4]), tree], [0, 3], [3, 3], torch.device("cpu"))
    assert not step.causal
    mask = step.query_mask.int().tolist()
    assert mask[3:] == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    # Only the branching request takes the tree path of the attention.
    rows = step.attention
    assert rows.batch_indices.tolist() == [1] and rows.query_rows.tolist() == [3, 4, 5]
    assert rows.query_start_loc.tolist() == [0, 3]
    assert rows.query_mask.int().tolist() == [[1, 0, 0], [1, 1, 0], [1, 0, 1]]


def test_padding_rows_of_a_uniform_step_see_up_to_the_root_and_no_row_sees_them():
    """A uniform step of width 4 (``uniform_widths``): a tree of 3 nodes and a
    chain of 1, each padded with -1 drafts to 4 (rows 4-8 and 9-13)."""
    tree = DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0], q=[0.6, 0.4, 1.0])
    step = build_step([0, 1], [tree, DraftTree.chain([8])], [4, 9], [5, 5], torch.device("cpu"), [1, 3])
    assert step.host_root_rows == [4, 9] and step.root_rows.tolist() == [4, 9]
    assert step.node_rows.tolist() == [5, 6, 7, 10]
    mask = step.query_mask.int().tolist()
    assert mask[:5] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 1, 0, 0], [1, 1, 0, 1, 0], [1, 0, 0, 0, 0]]
    assert mask[5:] == [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]
    assert step.attention.batch_indices.tolist() == [0]  # the padded chain stays causal-exact


def test_the_layout_dispatches_the_same_operations_at_every_batch_size():
    """Laid out on the host for all requests at once: no torch operation per
    request (the step's layout at batch 64 dispatches what it does at 8)."""
    from dispatched_ops import dispatched

    counts = []
    for batch in (8, 64):
        trees = [DraftTree(tokens=[5, 6, 7], parents=[-1, -1, 0], q=[0.6, 0.4, 1.0]), DraftTree.chain([8, 9])] * (batch // 2)
        lengths = [1 + len(tree) for tree in trees]
        starts = [sum(lengths[:k]) for k in range(batch)]
        counts.append(dispatched(build_step, list(range(batch)), trees, starts, lengths, torch.device("cpu")))
    assert counts[0] == counts[1]


def _is_ancestor(tree: DraftTree, node: int, other: int) -> bool:
    """Whether ``other`` is ``node`` or one of its ancestors."""
    while node != -1:
        if node == other:
            return True
        node = tree.parents[node]
    return False


def _sees(tree: DraftTree, before: int, row: int, column: int) -> bool:
    """Whether a request's query row ``row`` sees its row ``column``, by the
    definition: causal before the root, the root and padding rows up to the
    root, a node up to the root and its own ancestors-or-self."""
    if row < before:
        return column <= row
    node, other = row - before - 1, column - before - 1
    if 0 <= node < len(tree) and 0 <= other < len(tree):
        return _is_ancestor(tree, node, other)
    return column <= before


def test_random_steps_follow_the_definition():
    """Random trees (chains and branching ones, rows before the root, padding
    rows) laid out as the definition says, row by row and node by node."""
    rng = torch.Generator().manual_seed(0)

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (1,), generator=rng))

    for _ in range(200):
        batch = 1 + draw(6)
        trees, befores, paddings = [], [], []
        for _ in range(batch):
            n = 1 + draw(10)
            parents = [-1 if i == 0 or draw(3) == 0 else (i - 1 if draw(2) else draw(i)) for i in range(n)]
            trees.append(DraftTree(list(range(n)), parents, [0.5] * n))
            befores.append(draw(3))
            paddings.append(draw(3))
        lengths = [b + 1 + len(t) + p for b, t, p in zip(befores, trees, paddings)]
        starts = [sum(lengths[:k]) + 2 * k for k in range(batch)]
        step = build_step(list(range(batch)), trees, starts, lengths, torch.device("cpu"), paddings)
        mask, width, first = step.query_mask.tolist(), max(lengths), 0
        for tree, before, length in zip(trees, befores, lengths):
            for row in range(length):
                assert mask[first + row] == [_sees(tree, before, row, c) and c < length for c in range(width)]
            first += length
        depths = [d for tree in trees for d in tree.depths()]
        assert step.node_offsets.tolist() == [d - 1 - i for tree in trees for i, d in enumerate(tree.depths())]
        assert len(depths) == step.node_rows.numel()
        branching = [k for k, tree in enumerate(trees) if tree.parents != list(range(-1, len(tree) - 1))]
        assert (step.attention is None) == (not branching)
        if branching:
            assert step.attention.batch_indices.tolist() == branching
