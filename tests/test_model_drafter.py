"""The model drafter's growth logic over a fake backend (a fixed table of
next-token distributions keyed by the node's token): chain and EAGLE-2 trees
come out as their definitions say, and nodes the backend cannot feed get no
children."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from kernels.draft_distribution import DraftDistribution, draft_distribution_reference
from vllm_adaptive_spec.drafters.model import Eagle3Drafter
from vllm_adaptive_spec.policies import ChainPolicy, Eagle2Policy
from vllm_adaptive_spec.step.growth import grow

VOCAB = 7


class TableBackend:
    """Node distributions depend only on the node's token; ``capacity`` nodes
    per request at most are fed. Distributions are summarised by the same
    reference as the engine's backend (``kernels.draft_distribution``)."""

    top_k, top_m = 1, 0
    fixed_layers = False

    def __init__(self, roots: torch.Tensor, table: torch.Tensor, capacity: int = 1000) -> None:
        self.roots, self.table, self.capacity = roots, table, capacity
        self.fed_tokens: list[list[int]] = []

    def summary(self, probs: torch.Tensor) -> DraftDistribution:
        flat = draft_distribution_reference(probs.reshape(-1, probs.shape[-1]).log(), self.top_k, self.top_m)
        return DraftDistribution(*(x.view(*probs.shape[:-1], *x.shape[1:]) for x in flat))

    def begin(self, rows):
        return SimpleNamespace(roots=self.summary(self.roots[rows]), count=torch.zeros(len(rows), dtype=torch.long))

    def feed(self, scratch, live, tokens, parents):
        rank = live.long().cumsum(1) - 1
        ids = scratch.count.unsqueeze(1) + rank
        fed = live & (ids < self.capacity)
        scratch.count += fed.sum(1)
        self.fed_tokens.append(tokens[fed].tolist())
        dist = self.summary(self.table[tokens.clamp(min=0)])
        dist = dist._replace(probs=torch.where(fed.unsqueeze(-1), dist.probs, 0.0))
        return torch.where(fed, ids, -1), dist


def make(seed: int = 0, batch: int = 2):
    gen = torch.Generator().manual_seed(seed)
    roots = torch.rand(batch, VOCAB, generator=gen).softmax(-1)
    table = (3 * torch.rand(VOCAB, VOCAB, generator=gen)).softmax(-1)
    return roots, table


def grow_with(backend, policy, max_nodes, batch=2):
    drafter = Eagle3Drafter()
    drafter.bind(backend, policy.fanout, policy.entropy_top_m)
    drafter.prepare([f"r{b}" for b in range(batch)], [None] * batch, list(range(batch)))
    return grow(drafter, policy, torch.full((batch,), max_nodes), drafter.max_depth)[0]


def paths(tree):
    out = []
    for node in range(len(tree)):
        path, at = [], node
        while at >= 0:
            path.append(tree.tokens[at])
            at = tree.parents[at]
        out.append(tuple(reversed(path)))
    return out


def test_chain_is_the_greedy_path():
    roots, table = make()
    trees = grow_with(TableBackend(roots, table), ChainPolicy(), max_nodes=4)
    for b, tree in enumerate(trees):
        token = int(roots[b].argmax())
        expected = [token]
        for _ in range(3):
            token = int(table[token].argmax())
            expected.append(token)
        assert tree.tokens == expected and tree.parents == [-1, 0, 1, 2]


def test_eagle2_tree_matches_its_definition():
    roots, table = make(seed=1)
    k, depth, max_nodes = 2, 3, 5
    trees = grow_with(TableBackend(roots, table), Eagle2Policy(top_k=k, depth=depth), max_nodes)
    for b, tree in enumerate(trees):
        # Brute force: layer by layer, the K best children by path probability.
        frontier = [((t,), float(roots[b, t])) for t in roots[b].topk(k).indices.tolist()]
        grown = list(frontier)
        for _ in range(depth - 1):
            children = [
                (path + (t,), p * float(table[path[-1], t]))
                for path, p in frontier
                for t in table[path[-1]].topk(k).indices.tolist()
            ]
            frontier = sorted(children, key=lambda c: -c[1])[:k]
            grown += frontier
        kept = sorted(grown, key=lambda c: -c[1])[:max_nodes]
        assert sorted(paths(tree)) == sorted(path for path, _ in kept)
        assert all(tree.parents[i] < i for i in range(len(tree)))


def test_nodes_beyond_the_scratch_get_no_children():
    roots, table = make(seed=2)
    backend = TableBackend(roots, table, capacity=3)
    trees = grow_with(backend, Eagle2Policy(top_k=2, depth=4), max_nodes=30)
    for tree in trees:
        expanded = {tree.parents[i] for i in range(len(tree)) if tree.parents[i] >= 0}
        assert len(expanded) <= 3
    # Depth stops at the policy's D: at most K * (D - 1) nodes are ever fed.
    unlimited = TableBackend(roots, table)
    grow_with(unlimited, Eagle2Policy(top_k=2, depth=4), max_nodes=30)
    assert sum(len(t) for t in unlimited.fed_tokens) == 2 * 2 * 3
