"""Tree growth (growth.grow) with the chain and retrieval policies, on a fake
drafter that reads fixed synthetic tries."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from vllm_adaptive_spec.policies import ChainPolicy, RetrievalPolicy, top_by_path_probability
from vllm_adaptive_spec.trees.candidates import Candidates, Growth
from vllm_adaptive_spec.step.growth import grow
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree


class FakeDrafter:
    """``tries[b]`` is a list of ``(parent, token, q)`` (parents first, any
    order otherwise); a handle is a node's index in that list (-1: the root)."""

    growth = Growth.LAYERS

    def __init__(self, tries: list[list[tuple[int, int, float]]]) -> None:
        self.tries = tries
        self.kids = [
            {node: sorted((i for i, n in enumerate(trie) if n[0] == node), key=lambda i: -trie[i][2])
             for node in range(-1, len(trie))}
            for trie in tries
        ]

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        batch, width = handles.shape
        lists = [[self.kids[b][int(handles[b, f])] if live[b, f] else [] for f in range(width)] for b in range(batch)]
        fanout = max([1] + [len(kids) for row in lists for kids in row])
        tokens = torch.full((batch, width, fanout), -1, dtype=torch.long)
        q = torch.zeros(batch, width, fanout)
        out = torch.full((batch, width, fanout), -1, dtype=torch.long)
        for b, row in enumerate(lists):
            for f, kids in enumerate(row):
                for c, i in enumerate(kids):
                    tokens[b, f, c], q[b, f, c], out[b, f, c] = self.tries[b][i][1], self.tries[b][i][2], i
        return Candidates(tokens, q, out)


def random_trie(rng: random.Random, n: int) -> list[tuple[int, int, float]]:
    """Random trie (often deep); sibling q are count shares (counts 1..3), so
    equal path probabilities are common."""
    parents = [i - 1 if rng.random() < 0.5 else rng.randrange(-1, i) for i in range(n)]
    trie: list = [None] * n
    for parent in set(parents):
        kids = [i for i in range(n) if parents[i] == parent]
        counts = [rng.randint(1, 3) for _ in kids]
        for token, (kid, count) in enumerate(zip(kids, counts)):
            trie[kid] = (parent, 100 + token, count / sum(counts))
    return trie


def naive_bfs(drafter: FakeDrafter, b: int) -> tuple[list[int], list[int], list[np.float32]]:
    """Trie nodes in breadth-first order (children by descending q), their
    depths, and their float32 path probabilities computed as grow does."""
    trie, kids = drafter.tries[b], drafter.kids[b]
    order, depth, p = [], {-1: 0}, {-1: np.float32(1.0)}
    queue = list(kids[-1])
    while queue:
        node = queue.pop(0)
        parent = trie[node][0]
        order.append(node)
        depth[node], p[node] = depth[parent] + 1, p[parent] * np.float32(trie[node][2])
        queue += kids[node]
    return order, [depth[i] for i in order], [p[i] for i in order]


def naive_retrieval(drafter: FakeDrafter, b: int, max_nodes: int, max_depth: int, min_p: float = 0.0) -> DraftTree:
    """Whole trie down to ``max_depth``, nodes with p >= min_p; keep the top
    ``max_nodes`` by p (earlier wins ties)."""
    order, depth, p = naive_bfs(drafter, b)
    slots = [k for k in range(len(order)) if depth[k] <= max_depth and p[k] >= min_p]
    kept = sorted(sorted(slots, key=lambda k: (-p[k], k))[:max_nodes])
    index = {order[k]: new for new, k in enumerate(kept)}
    trie = drafter.tries[b]
    nodes = [trie[order[k]] for k in kept]
    return DraftTree(
        [token for _, token, _ in nodes],
        [ROOT if parent == ROOT else index[parent] for parent, _, _ in nodes],
        [float(np.float32(q)) for _, _, q in nodes],
    )


def naive_chain(drafter: FakeDrafter, b: int, max_nodes: int, max_depth: int) -> DraftTree:
    node, path = ROOT, []
    while drafter.kids[b][node] and len(path) < min(max_nodes, max_depth):
        node = drafter.kids[b][node][0]
        path.append(node)
    trie = drafter.tries[b]
    return DraftTree([trie[i][1] for i in path], list(range(-1, len(path) - 1)), [float(np.float32(trie[i][2])) for i in path])


# root -> 1 (.6), 2 (.4); 1 -> 3 (.5), 4 (.5); 2 -> 5 (1); 3 -> 6 (1).
# Path probabilities by BFS node: .6 .4 .3 .3 .4 .3
EXAMPLE = [(-1, 1, 0.6), (-1, 2, 0.4), (0, 3, 0.5), (0, 4, 0.5), (1, 5, 1.0), (2, 6, 1.0)]


def test_retrieval_policy_example():
    drafter = FakeDrafter([EXAMPLE] * 5)
    trees, _ = grow(drafter, RetrievalPolicy(min_p=0.0), torch.tensor([0, 3, 4, 6, 100]), max_depth=32)
    assert [(t.tokens, t.parents) for t in trees] == [
        ([], []),
        ([1, 2, 5], [-1, -1, 1]),  # .6 .4 .4
        ([1, 2, 3, 5], [-1, -1, 0, 1]),  # + the first of the .3 ties
        ([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2]),  # the whole trie
        ([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2]),
    ]
    assert trees[3].q == pytest.approx([0.6, 0.4, 0.5, 0.5, 1.0, 1.0])


def test_chain_policy_example():
    drafter = FakeDrafter([EXAMPLE] * 4)
    trees, _ = grow(drafter, ChainPolicy(), torch.tensor([0, 2, 10, 1]), max_depth=32)
    assert [(t.tokens, t.parents) for t in trees] == [([], []), ([1, 3], [-1, 0]), ([1, 3, 6], [-1, 0, 1]), ([1], [-1])]
    assert trees[2].q == pytest.approx([0.6, 0.5, 1.0])


def test_chain_stops_drafting_at_the_budget():
    """A chain of N nodes costs N draft passes, not one more."""
    long_chain = [(i - 1, 10 + i, 1.0) for i in range(8)]
    _, stats = grow(FakeDrafter([long_chain]), ChainPolicy(), torch.tensor([3]), max_depth=32)
    assert stats.draft_passes == 3


@pytest.mark.parametrize("seed", range(30))
def test_grow_matches_naive(seed):
    rng = random.Random(seed)
    drafter = FakeDrafter([random_trie(rng, rng.randint(0, 25)) for _ in range(5)])
    max_nodes = [rng.randint(0, 30) for _ in range(5)]
    max_depth = rng.choice([2, 32])
    cases = (
        (RetrievalPolicy(min_p=0.0), naive_retrieval),
        (RetrievalPolicy(min_p=0.2), lambda *args: naive_retrieval(*args, min_p=0.2)),
        (ChainPolicy(), naive_chain),
    )
    for policy, naive in cases:
        trees, _ = grow(drafter, policy, torch.tensor(max_nodes), max_depth)
        for b, tree in enumerate(trees):
            tree.validate()
            assert tree == naive(drafter, b, max_nodes[b], max_depth), (policy.name, b)


def test_top_by_path_probability_ties_and_padding():
    p = torch.tensor([[0.5, 0.5, 0.2, 0.5]] * 4)
    valid = torch.tensor([[True] * 4, [False, True, True, True], [True] * 4, [True, True, True, False]])
    keep = top_by_path_probability(p, valid, torch.tensor([2, 2, 0, 9]))
    assert keep.tolist() == [[True, True, False, False], [False, True, False, True], [False] * 4, [True, True, True, False]]


def test_top_by_path_probability_random_trees():
    rng = random.Random(0)
    for _ in range(20):
        drafter = FakeDrafter([random_trie(rng, rng.randint(0, 25)) for _ in range(6)])
        bfs = [naive_bfs(drafter, b) for b in range(6)]
        width = max(len(order) for order, _, _ in bfs) + 2
        p, valid = torch.zeros(6, width), torch.zeros(6, width, dtype=torch.bool)
        for b, (order, _, probs) in enumerate(bfs):
            p[b, : len(order)], valid[b, : len(order)] = torch.tensor(np.array(probs, dtype=np.float32)), True
        max_nodes = [rng.randint(0, width) for _ in range(6)]
        keep = top_by_path_probability(p, valid, torch.tensor(max_nodes))
        for b, (order, _, probs) in enumerate(bfs):
            expected = set(sorted(range(len(order)), key=lambda k: (-probs[k], k))[: max_nodes[b]])
            assert {k for k in range(width) if keep[b, k]} == expected
            position = {node: k for k, node in enumerate(order)}
            for k in expected:  # closed under ancestors
                parent = drafter.tries[b][order[k]][0]
                assert parent == ROOT or position[parent] in expected
