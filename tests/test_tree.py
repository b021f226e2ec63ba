"""DraftTree, TreeBatch and HostTrees (docs/algorithms.md section 0: breadth-first layout)."""

from __future__ import annotations

import random

import pytest

from vllm_adaptive_spec.trees.tree import ROOT, DraftTree, HostTrees, TreeBatch


def random_bfs_tree(rng: random.Random, n: int, vocab: int = 32) -> DraftTree:
    """A random tree of ``n`` nodes in breadth-first order, distinct sibling tokens."""
    raw_parents = [rng.randrange(-1, i) for i in range(n)]
    raw_depth: list[int] = []
    for parent in raw_parents:
        raw_depth.append(1 if parent == ROOT else raw_depth[parent] + 1)
    order = sorted(range(n), key=lambda i: raw_depth[i])  # stable: parents stay first
    new_index = {old: new for new, old in enumerate(order)}
    parents = [ROOT if raw_parents[old] == ROOT else new_index[raw_parents[old]] for old in order]
    tokens = [0] * n
    for parent in set(parents):
        kids = [i for i in range(n) if parents[i] == parent]
        for kid, token in zip(kids, rng.sample(range(vocab), len(kids))):
            tokens[kid] = token
    return DraftTree(tokens, parents, [rng.random() for _ in range(n)])


def naive_ancestors(tree: DraftTree, i: int) -> set[int]:
    """Node ``i`` and its ancestors, by walking up the parent chain."""
    out = set()
    while i != ROOT:
        out.add(i)
        i = tree.parents[i]
    return out


def random_trees(seed: int) -> list[DraftTree]:
    rng = random.Random(seed)
    return [DraftTree()] + [random_bfs_tree(rng, rng.randint(0, 20)) for _ in range(5)]


def test_depths_prefix_chain():
    tree = DraftTree([5, 6, 7, 8, 9], [-1, -1, 0, 0, 2], [0.5, 0.4, 0.9, 0.1, 1.0])
    tree.validate()
    assert tree.depths() == [1, 1, 2, 2, 3]
    head = tree.prefix(3)
    assert (head.tokens, head.parents, head.q) == ([5, 6, 7], [-1, -1, 0], [0.5, 0.4, 0.9])
    head.validate()
    chain = DraftTree.chain([4, 4, 2])
    assert (chain.tokens, chain.parents, chain.q) == ([4, 4, 2], [-1, 0, 1], [1.0, 1.0, 1.0])
    assert chain.depths() == [1, 2, 3]
    chain.validate()
    assert DraftTree.chain([]).depths() == []


@pytest.mark.parametrize(
    "tree, message",
    [
        (DraftTree([1, 2], [-1, 1], [1.0, 1.0]), "node 1 has parent 1"),  # own parent
        (DraftTree([1, 2, 3], [-1, 2, -1], [1.0] * 3), "node 1 has parent 2"),  # parent after child
        (DraftTree([1, 2], [-1, -2], [1.0, 1.0]), "node 1 has parent -2"),
        (DraftTree([1, 2, 1], [-1, -1, -1], [1.0] * 3), "node 2 repeats token 1"),
        (DraftTree([1, 3, 3], [-1, 0, 0], [1.0] * 3), "node 2 repeats token 3"),
        (DraftTree([1, 2, 3], [-1, 0, -1], [1.0] * 3), "breadth-first"),  # depth 1, 2, 1
        (DraftTree([1, 2], [-1, 0], [1.0]), "differ in length"),
    ],
)
def test_validate_rejects(tree, message):
    with pytest.raises(ValueError, match=message):
        tree.validate()


def test_validate_accepts_same_token_under_different_parents():
    DraftTree([1, 2, 1, 1], [-1, -1, 0, 1], [1.0] * 4).validate()


def test_random_trees_are_valid():
    for tree in random_trees(0):
        tree.validate()


def test_from_trees_padding_and_valid():
    trees = [DraftTree([3, 4, 5], [-1, -1, 1], [1.0] * 3), DraftTree(), DraftTree.chain([7])]
    batch = TreeBatch.from_trees(trees)
    assert batch.width == 3
    assert batch.tokens.tolist() == [[3, 4, 5], [-1, -1, -1], [7, -1, -1]]
    assert batch.parents.tolist() == [[-1, -1, 1], [-1, -1, -1], [-1, -1, -1]]
    assert batch.num_nodes.tolist() == [3, 0, 1]
    assert batch.valid().tolist() == [[True] * 3, [False] * 3, [True, False, False]]
    wide = TreeBatch.from_trees(trees, width=5)
    assert wide.width == 5 and wide.tokens[0].tolist() == [3, 4, 5, -1, -1]
    assert TreeBatch.from_trees([DraftTree()]).width == 0


@pytest.mark.parametrize("seed", range(20))
def test_masks_and_depths_match_naive_walk(seed):
    trees = random_trees(seed)
    batch = TreeBatch.from_trees(trees)
    width = batch.width
    ancestors, rows = batch.ancestor_mask(), batch.row_mask()
    depths = ancestors.sum(-1)  # a node's depth is its number of ancestors-or-self
    assert ancestors.shape == (len(trees), width, width)
    assert rows.shape == (len(trees), width + 1, width + 1)
    for b, tree in enumerate(trees):
        n = len(tree)
        expected = [[j in naive_ancestors(tree, i) for j in range(width)] for i in range(n)]
        expected += [[False] * width] * (width - n)
        assert ancestors[b].tolist() == expected
        assert depths[b].tolist() == tree.depths() + [0] * (width - n)
        # Row 0 (the root) sees only itself; node rows see the root and ancestors-or-self.
        assert rows[b, 0].tolist() == [True] + [False] * width
        for i in range(n):
            assert rows[b, i + 1].tolist() == [True] + expected[i]


@pytest.mark.parametrize("seed", range(20))
def test_host_trees_match_the_naive_walk(seed):
    """The host layout (numpy, the uniform step's buffers): the same
    ancestors and depths as walking every node's parents one by one."""
    trees = random_trees(seed) + [DraftTree.chain([4, 5, 6])]
    host = HostTrees.of(trees, width=24)
    assert host.ancestors.shape == (len(trees), 24, 24)
    for b, tree in enumerate(trees):
        n = len(tree)
        expected = [[j in naive_ancestors(tree, i) for j in range(24)] for i in range(n)]
        assert host.ancestors[b].tolist() == expected + [[False] * 24] * (24 - n)
        assert host.depths()[b].tolist() == tree.depths() + [0] * (24 - n)
        assert host.tokens[b].tolist() == tree.tokens + [-1] * (24 - n)
        assert host.parents[b].tolist() == tree.parents + [ROOT] * (24 - n)
    assert HostTrees.of([]).tokens.shape == (0, 0)
    chains = HostTrees.of([DraftTree.chain([1, 2]), DraftTree(), DraftTree.chain([3, 4, 5])], width=4)
    assert chains.ancestors.tolist() == [[[j <= i < n for j in range(4)] for i in range(4)] for n in (2, 0, 3)]


def test_main_path_and_keep_best():
    # p: .6 .4 .3 .3 .4 .3 (nodes 2, 3 children of 0; 4 child of 1; 5 child of 2)
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2], [0.6, 0.4, 0.5, 0.5, 1.0, 1.0])
    assert tree.main_path() == DraftTree([1, 3, 6], [-1, 0, 1], [0.6, 0.5, 1.0])  # ties: earlier node
    assert tree.branches() and not tree.main_path().branches()
    assert tree.keep_best(3) == DraftTree([1, 2, 5], [-1, -1, 1], [0.6, 0.4, 1.0])
    assert tree.keep_best(0) == DraftTree() and tree.keep_best(9) is tree
    # p >= 0.35: nodes 0, 1 and 4 (node 4's p 0.4 under node 1), closed under ancestors.
    assert tree.at_least(0.35) == DraftTree([1, 2, 5], [-1, -1, 1], [0.6, 0.4, 1.0])
    assert tree.at_least(0.3) is tree and tree.at_least(0.7) == DraftTree()
