"""The seeds' adaptive policies (TALON, DEAGLE, DynaTree) grow the trees their
definitions (docs/algorithms.md sections 3, 5, 6) describe, checked against
brute-force re-implementations on a fake model drafter; every policy's trees
are valid, within budget and scratch, and verified losslessly; DynaTree's
per-request history is kept, used and forgotten."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from test_model_drafter import TableBackend, grow_with, paths
from test_verify import chi_square_pvalue, committed_pair_counts
from vllm_adaptive_spec.config import TreeConfig, TreeConfigError, parse_tree_config
from vllm_adaptive_spec.policies import (
    ChainPolicy,
    DeaglePolicy,
    DynaTreePolicy,
    Eagle2Policy,
    TalonPolicy,
)
from vllm_adaptive_spec.trees.tree import DraftTree


def table_model(seed: int, batch: int = 3, vocab: int = 24, sharpness: float = 4.0):
    gen = torch.Generator().manual_seed(seed)
    roots = (sharpness * torch.randn(batch, vocab, generator=gen)).softmax(-1)
    table = (sharpness * torch.randn(vocab, vocab, generator=gen)).softmax(-1)
    return roots, table


def children(dist: torch.Tensor, k: int) -> list[tuple[int, float]]:
    q, t = dist.topk(min(k, dist.shape[0]))
    return list(zip(t.tolist(), q.tolist()))


def best(nodes, k):
    return sorted(nodes, key=lambda n: -n[1])[: max(k, 0)]


def talon_reference(root, table, n, top_k, mu, k_c, max_depth):
    tree, frontier, depth = [], [((), 1.0)], 0
    while len(tree) < n and frontier and depth < max_depth:
        cand = [
            (path + (t,), p * q)
            for path, p in frontier
            for t, q in children(root if not path else table[path[-1]], k_c)
        ]
        cand = [c for c in cand if c[1] > 0]
        if depth == 0:
            layer = best(cand, top_k)
        else:
            top = max((c[1] for c in cand), default=0.0)
            layer = [c for c in cand if c[1] >= mu * top]
        if len(tree) + len(layer) > n:
            layer = best(layer, n - len(tree))
        tree += layer
        frontier, depth = layer, depth + 1
    return sorted(path for path, _ in tree)


def deagle_reference(root, table, n, top_k, depth, tau_s, tau_rho):
    frontier = best([((t,), q) for t, q in children(root, top_k)], top_k)
    grown, last, hits, expected = list(frontier), None, 0, 0.0
    for d in range(1, depth + 1):
        if d > 1:
            cand = [(path + (t,), p * q) for path, p in frontier for t, q in children(table[path[-1]], top_k)]
            frontier = best(cand, top_k)
            grown += frontier
        s = sum(p for _, p in frontier)
        if last is not None and s < tau_rho * last:
            hits += 1
        last, expected = s, expected + s
        if (s < tau_s) + (hits >= 2) + (d >= math.ceil(expected)) >= 2:
            break
    return sorted(path for path, _ in best(grown, n)), d


def dynatree_reference(root, table, n, d0, d_max, branches, tau_h, tau_l, tau, rho_stop, rho_deep):
    tree, frontier = [], [((), 1.0)]
    for depth in range(1, d_max + 1):
        if len(tree) >= n or not frontier:
            break
        layer = []
        for path, p in frontier:
            parent_depth = depth - 1
            if not (p >= rho_stop and parent_depth < d_max and (parent_depth < d0 or p >= rho_deep)):
                continue
            dist = root if not path else table[path[-1]]
            c = float(dist.max())
            width = branches[0] if c >= tau_h else branches[1] if c >= tau_l else branches[2]
            layer += [(path + (t,), p * q) for t, q in children(dist, width) if p * q >= tau]
        if len(tree) + len(layer) > n:
            layer = best(layer, n - len(tree))
        tree += layer
        frontier = layer
    return sorted(path for path, _ in tree)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("mu", [0.03, 0.3])
def test_talon_matches_its_definition(seed, mu):
    roots, table = table_model(seed)
    n, top_k, k_c = 12 + 4 * seed, 3, 5
    policy = TalonPolicy(top_k=top_k, mu=mu, k_c=k_c, max_depth=6)
    trees = grow_with(TableBackend(roots, table), policy, n, batch=3)
    for b, tree in enumerate(trees):
        assert sorted(paths(tree)) == talon_reference(roots[b], table, n, top_k, mu, k_c, 6)


def test_talon_goes_deep_where_the_drafter_is_sure_and_wide_where_not():
    vocab = 24
    sure = torch.full((vocab, vocab), 1e-4)
    sure[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 1.0
    sure = sure / sure.sum(-1, keepdim=True)
    unsure = torch.full((vocab, vocab), 1.0 / vocab)
    root = sure[:1]
    deep = grow_with(TableBackend(root, sure), TalonPolicy(top_k=1), 10, batch=1)[0]
    wide = grow_with(TableBackend(root, unsure), TalonPolicy(top_k=1), 10, batch=1)[0]
    assert max(deep.depths()) == 10 and not deep.branches()
    assert max(wide.depths()) == 2 and len(wide) == 10


@pytest.mark.parametrize("seed", range(6))
def test_deagle_matches_its_definition_and_saves_draft_passes(seed):
    roots, table = table_model(seed, sharpness=2.0 + seed)
    n, top_k, depth = 20, 3, 12
    backend = TableBackend(roots[:1], table)
    tree = grow_with(backend, DeaglePolicy(top_k=top_k, depth=depth), n, batch=1)[0]
    expected, stopped_at = deagle_reference(roots[0], table, n, top_k, depth, 0.15, 0.6)
    assert sorted(paths(tree)) == expected
    # The stopped tree's last layer is never fed to the drafter: depth - 1 fed layers.
    assert len(backend.fed_tokens) == stopped_at - 1
    plain = TableBackend(roots[:1], table)
    grow_with(plain, Eagle2Policy(top_k=top_k, depth=depth), n, batch=1)
    assert len(backend.fed_tokens) <= len(plain.fed_tokens)


def test_deagle_stops_early_on_a_flat_drafter_and_not_on_a_sure_one():
    vocab = 24
    flat = torch.full((vocab, vocab), 1.0 / vocab)
    sure = torch.full((vocab, vocab), 1e-4)
    sure[torch.arange(vocab), (torch.arange(vocab) + 1) % vocab] = 1.0
    sure = sure / sure.sum(-1, keepdim=True)
    for table, lowest, highest in ((flat, 1, 3), (sure, 10, 12)):
        backend = TableBackend(table[:1], table)
        grow_with(backend, DeaglePolicy(top_k=4, depth=12), 60, batch=1)
        assert lowest - 1 <= len(backend.fed_tokens) <= highest - 1


DYNA = dict(d0=2, d_max=5, branches=(1, 2, 3), tau_h=0.6, tau_l=0.2, tau=0.01, rho_stop=0.01, rho_deep=0.3)


def dyna_policy(**overrides) -> DynaTreePolicy:
    s = {**DYNA, **overrides}
    return DynaTreePolicy(
        d0=s["d0"], d_max=s["d_max"], branch_min=s["branches"][0], branch_mid=s["branches"][1],
        branch_max=s["branches"][2], tau_h=s["tau_h"], tau_l=s["tau_l"], tau=s["tau"],
        rho_stop=s["rho_stop"], rho_deep=s["rho_deep"],
    )


@pytest.mark.parametrize("seed", range(8))
def test_dynatree_matches_its_definition(seed):
    roots, table = table_model(seed, sharpness=1.0 + seed % 4)
    n = 8 + 3 * seed
    trees = grow_with(TableBackend(roots, table), dyna_policy(), n, batch=3)
    for b, tree in enumerate(trees):
        assert sorted(paths(tree)) == dynatree_reference(roots[b], table, n, **DYNA)


def test_dynatree_history_is_kept_used_and_forgotten():
    policy = DynaTreePolicy(window=2)
    deep_chain = DraftTree.chain([1, 2, 3, 4])
    for _ in range(2):  # two trees fully accepted: deeper and more willing to branch less
        policy.observe("good", deep_chain, 4)
        policy.observe("bad", deep_chain, 0)
    policy.observe("fresh", deep_chain, 4)  # one observation: the window is not full
    policy.begin(["good", "bad", "fresh", "new"])
    d0, tau_h = policy._rows(4, torch.device("cpu"))
    assert d0.tolist() == [6, 4, 5, 5]
    assert tau_h.tolist() == pytest.approx([0.85, 0.95, 0.9, 0.9])
    policy.forget("good")
    policy.begin(["good"])
    assert policy._rows(1, torch.device("cpu"))[0].tolist() == [5]
    # Tuned settings change the tree: a lower D_0 stops weak deep branches.
    roots, table = table_model(3, sharpness=1.0)
    strict = dyna_policy(d0=1)
    strict.begin(["a", "b", "c"])
    loose = dyna_policy(d0=5)
    shallow = grow_with(TableBackend(roots, table), strict, 30, batch=3)
    deep = grow_with(TableBackend(roots, table), loose, 30, batch=3)
    assert sum(len(t) for t in shallow) < sum(len(t) for t in deep)


def _policies_for_fuzz():
    return [
        ChainPolicy(),
        Eagle2Policy(top_k=3, depth=4),
        TalonPolicy(top_k=3, mu=0.05, k_c=4),
        DeaglePolicy(top_k=3, depth=8),
        dyna_policy(),
    ]


@pytest.mark.parametrize("policy", _policies_for_fuzz(), ids=lambda p: p.name)
def test_every_policy_builds_valid_trees_within_budget_and_scratch(policy):
    for seed in range(10):
        roots, table = table_model(seed, batch=4, sharpness=0.5 + seed / 2)
        budget = 1 + 3 * seed
        backend = TableBackend(roots, table)
        trees = grow_with(backend, policy, budget, batch=4)
        for tree in trees:
            tree.validate()
            assert len(tree) <= budget
            for parent in set(tree.parents):
                siblings = [t for t, p in zip(tree.tokens, tree.parents) if p == parent]
                assert len(siblings) == len(set(siblings))
        # The draft KV scratch the config reserves per request is never exceeded.
        assert sum(len(layer) for layer in backend.fed_tokens) <= 4 * policy.max_fed_nodes(budget)


V = 6


@pytest.mark.parametrize("policy", _policies_for_fuzz(), ids=lambda p: p.name)
def test_every_policy_tree_is_verified_losslessly(policy):
    """The trees each policy builds on a 6-token model, verified with row
    tokens sampled from random target laws: the first two committed tokens
    follow the target's joint law (chi-square, alpha = 1e-3, 100k trials)."""
    roots, table = table_model(7, batch=1, vocab=V, sharpness=1.5)
    tree = grow_with(TableBackend(roots, table), policy, 8, batch=1)[0]
    assert len(tree) >= 1
    rng = np.random.default_rng(0)
    P = rng.dirichlet(np.ones(V), size=1 + len(tree))
    Q = rng.dirichlet(np.ones(V), size=V)
    row_of = {tree.tokens[i]: 1 + i for i in range(len(tree)) if tree.parents[i] == -1}
    exact = np.stack([P[0, x] * (P[row_of[x]] if x in row_of else Q[x]) for x in range(V)])
    counts = committed_pair_counts(tree, P, Q, 100_000, torch.Generator().manual_seed(0))
    assert chi_square_pvalue(counts, exact) >= 1e-3


@pytest.mark.parametrize(
    "tree, message",
    [
        ({"policy": "talon", "mu": 0}, "'mu'] must be a number from 0 (exclusive) to 1"),
        ({"policy": "talon", "k_c": 100}, "'k_c'] must be an integer from 1 to 64"),
        ({"policy": "deagle", "tau_s": 1.5}, "'tau_s'] must be a number from 0 to 1"),
        ({"policy": "dynatree", "tau_l": 0.95}, "tau_l (0.95) must not exceed tau_h (0.9)"),
        ({"policy": "dynatree", "branch_min": 4}, "branch_min <= branch_mid <= branch_max"),
        ({"policy": "dynatree", "d0": 9}, "d0 (9) must not exceed d_max (8)"),
        ({"policy": "dynatree", "history_tuning": 1}, "'history_tuning'] must be true or false"),
        ({"policy": "talon", "tau_h": 0.5}, "unknown key(s) ['tau_h']"),
    ],
)
def test_bad_policy_settings_fail_with_the_key_and_the_rule(tree, message):
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 16, "model": "m", "tree": {"drafter": "eagle3", **tree}}
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(spec)
    assert message in str(error.value)


def test_policy_defaults_are_the_specs():
    talon, deagle, dyna = TalonPolicy(), DeaglePolicy(), DynaTreePolicy()
    assert (talon.top_k, talon.mu, talon.k_c, talon.max_depth) == (10, 0.03, 16, 32)
    assert (deagle.top_k, deagle.tau_s, deagle.tau_rho, deagle.depth) == (10, 0.15, 0.6, 18)
    assert (dyna.d0, dyna.d_max, dyna.branches, dyna.tau_h, dyna.tau_l, dyna.tau) == (5, 8, (1, 2, 3), 0.9, 0.4, 0.03)
    assert (dyna.rho_stop, dyna.rho_deep, dyna.window) == (0.01, 0.1, 8)


def proposer_for(config):
    """The engine adapter's proposer for a tree config (no engine: vLLM's config
    reduced to what the proposer reads)."""
    from types import SimpleNamespace

    from vllm_adaptive_spec.adapter.config_hook import ADDITIONAL_CONFIG_KEY
    from vllm_adaptive_spec.adapter.proposer import TreeProposer

    return TreeProposer(SimpleNamespace(additional_config={ADDITIONAL_CONFIG_KEY: config.to_dict()},
                                        model_config=SimpleNamespace(max_model_len=256),
                                        device_config=SimpleNamespace(device_type="cpu"),
                                        speculative_config=SimpleNamespace(num_speculative_tokens=config.max_nodes),
                                        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048)))


def test_the_proposer_keeps_policy_state_per_request_until_it_is_forgotten():
    """The engine adapter's proposer: ``begin`` with the step's requests,
    ``observe`` after verification, ``forget`` when vLLM reports a request
    finished or preempted."""
    config = TreeConfig("retrieval", "dynatree", 8, policy_params={"window": 1, "tau_h": 0.9}, load_budget="fixed")
    proposer = proposer_for(config)
    tokens = np.array([[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]])
    drafts = proposer.propose_trees(["a", "b"], [[6], [2]], np.array([8, 8]), tokens, [True, True])
    assert all(drafts)  # both repeat their context: the retrieval drafter finds continuations
    trees = [proposer.trees["a"], proposer.trees["b"]]
    proposer.observe(["a", "b"], trees, [list(range(max(trees[0].depths()))), []])
    history = proposer.policy._history
    assert history["a"].tau_h == pytest.approx(0.85) and history["b"].tau_h == pytest.approx(0.95)
    proposer.forget(["a"])
    assert "a" not in history and "b" in history


def test_a_request_whose_drafting_raises_loses_only_its_own_tree(monkeypatch):
    """The drafter raises whenever request "b" is in its batch: the step's
    requests are drafted again one by one, "b" goes without a tree, "a" and
    "c" keep theirs (the same as without "b"), and nothing is raised."""
    config = TreeConfig("retrieval", "retrieval", 8, load_budget="fixed")
    proposer = proposer_for(config)
    prepare = type(proposer.drafter).prepare

    def failing(drafter, request_ids, *args, **kwargs):
        if "b" in request_ids:
            raise RuntimeError("injected")
        return prepare(drafter, request_ids, *args, **kwargs)

    monkeypatch.setattr(type(proposer.drafter), "prepare", failing)
    tokens = np.array([[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2], [4, 8, 9, 4, 8, 9, 4, 8]])
    drafts = proposer.propose_trees(["a", "b", "c"], [[6], [2], [8]], np.array([8, 8, 8]), tokens, [True] * 3)
    alone = proposer_for(config).propose_trees(["a", "c"], [[6], [8]], np.array([8, 8]), tokens[[0, 2]], [True] * 2)
    assert drafts[1] == [] and [drafts[0], drafts[2]] == alone and all(alone)
    assert proposer.failures.count == 2 and "b" not in proposer.trees


def test_contexts_include_the_sampled_tokens_vllm_has_not_stored_yet():
    """Model drafters run before vLLM writes the step's sampled tokens into
    its token table: the retrieval side (hybrid) must still see them, so its
    context is the committed tokens followed by the step's samples."""
    config = TreeConfig("retrieval", "retrieval", 8, {"evidence_prior": 0.0}, {"min_p": 0.05}, load_budget="fixed")
    proposer = proposer_for(config)
    stale = 9  # what the table holds past the committed tokens (an old draft)
    tokens = np.array([[5, 6, 7, 1, stale, stale, stale, stale]])
    drafts = proposer.propose_trees(["a"], [[5, 6]], np.array([6]), tokens, [True], sampled_pending=True)
    assert drafts[0][:2] == [7, 1]  # [5, 6] matched: what followed it, not what followed [9, 9]


def test_a_model_drafters_first_pass_counts_as_drafting_cost():
    """A model drafter's pass over the committed tokens runs before
    ``propose_trees`` (in the runner); the load budget must see it as part of
    the drafting cost, or a drafter looks cheaper than it is and keeps
    drafting where it loses."""
    proposer = proposer_for(TreeConfig("retrieval", "retrieval", 8, load_budget="adaptive"))
    assert not proposer.load_budget.pauses.realized  # a retrieval drafter's windows are judged on the expectation
    tokens = np.array([[5, 6, 7, 5, 6, 7, 5, 6], [1, 2, 3, 1, 2, 3, 1, 2]])
    proposer.propose_trees(["a", "b"], [[6], [2]], np.array([8, 8]), tokens, [True, True], first_pass_seconds=0.5)
    assert 0.25 <= proposer.load_budget.draft_cost() < 0.3  # half a second over two drafting requests, plus growth


def test_the_proposer_counts_trees_accepted_down_to_a_leaf():
    """``leaf_paths`` (the best case of drafting ahead on a guessed outcome)
    counts the verified trees whose accepted path ends at a leaf."""
    proposer = proposer_for(TreeConfig("retrieval", "retrieval", 8, load_budget="fixed"))
    tree = DraftTree([4, 5, 6, 7], [-1, -1, 0, 2], [0.5, 0.4, 0.5, 0.5])  # 4 -> 6 -> 7, and 5
    proposer.observe(["a", "b", "c", "d"], [tree] * 4, [[0, 2, 3], [1], [0, 2], []])
    assert proposer.stats.as_dict()["leaf_paths"] == 2
