"""The load-following node budget (no engine)."""

import numpy as np
import pytest

from vllm_adaptive_spec.budget import LoadBudget, budget_ranks
from vllm_adaptive_spec.tree import DraftTree


def test_ranks_follow_path_probability_and_keep_ancestors_first():
    # p: .6 .4 .3 .3 .4 .3 (nodes 2, 3 children of 0; 4 child of 1; 5 child of 2)
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2], [0.6, 0.4, 0.5, 0.5, 1.0, 1.0])
    assert budget_ranks(tree) == [0, 1, 3, 4, 2, 5]


def test_one_tree_measures_every_smaller_budget():
    budget = LoadBudget(max_budget=6)
    tree = DraftTree([1, 2, 3, 4, 5, 6], [-1, -1, 0, 0, 1, 2], [0.6, 0.4, 0.5, 0.5, 1.0, 1.0])
    budget.observe_tree(tree, accepted_nodes=[0, 2, 5], informs=6)  # path 0 -> 2 -> 5: ranks 0, 3, 5
    assert budget.accepted().tolist() == [0, 1, 1, 1, 2, 2, 3]


def test_a_small_tree_speaks_for_its_drafting_budget_only():
    budget = LoadBudget(max_budget=8)
    budget.observe_tree(DraftTree.chain([4, 5]), accepted_nodes=[0, 1], informs=4)
    gains = budget.accepted()
    assert gains[:5].tolist() == [0, 1, 2, 2, 2]
    assert np.isnan(gains[5:]).all()


def _feed(budget: LoadBudget, alpha: float, beta: float, accept_per_rank: float, steps: int = 40) -> None:
    rng = np.random.default_rng(0)
    chain = DraftTree.chain(list(range(budget.max_budget)))
    for step in range(steps):
        tokens = int(rng.integers(4, 200))
        budget.observe_step(tokens, alpha + beta * tokens)
        # Each node on the chain is accepted with ``accept_per_rank`` if its parent was.
        accepted = int(min(rng.geometric(1 - accept_per_rank) - 1, budget.max_budget))
        budget.observe_tree(chain, list(range(accepted)), informs=budget.max_budget)


def test_cost_fit_recovers_a_linear_step_time():
    budget = LoadBudget(max_budget=8)
    assert budget.cost() is None
    _feed(budget, alpha=0.02, beta=0.001, accept_per_rank=0.5)
    alpha, beta = budget.cost()
    assert alpha == pytest.approx(0.02) and beta == pytest.approx(0.001)


def test_budget_shrinks_with_load_down_to_no_speculation():
    budget = LoadBudget(max_budget=16, explore_every=1000)
    _feed(budget, alpha=0.05, beta=0.002, accept_per_rank=0.5, steps=400)
    picks = [budget.choose(requests, 0) for requests in (1, 4, 16, 64, 256)]
    assert picks == sorted(picks, reverse=True)
    assert 0 < picks[0] < 16, "acceptance saturates: the full budget is not worth it"
    assert picks[-1] == 0


def test_full_budget_when_every_node_pays():
    budget = LoadBudget(max_budget=16, explore_every=1000)
    _feed(budget, alpha=0.05, beta=0.002, accept_per_rank=0.95, steps=400)
    assert budget.choose(1, 0) == 16


def test_full_budget_until_measured_then_one_exploring_step_in_n():
    budget = LoadBudget(max_budget=12, explore_every=3)
    assert budget.choose(64, 0) == 12  # nothing measured yet
    _feed(budget, alpha=0.05, beta=0.01, accept_per_rank=0.05)
    assert budget.choose(64, 0) == 0
    assert [budget.explores() for _ in range(6)] == [False, False, True, False, False, True]
