"""Newcomers' probes (no engine): while the load budget pauses drafting, a
request that has never had a tree verified still gets one, chosen as the
budget would choose it and at least its best node, without moving the pause
control; once verified it waits for the pause to end like every other."""

import numpy as np
from test_budget import _feed_steps
from test_cost_models import shape_budget
from test_policies import proposer_for

from vllm_adaptive_spec.budget.cost_table import StepCostTable
from vllm_adaptive_spec.budget.load_budget import LoadBudget
from vllm_adaptive_spec.budget.pause_control import StepDecision
from vllm_adaptive_spec.config import TreeConfig
from vllm_adaptive_spec.trees.tree import DraftTree

PAUSED = StepDecision(drafts=False)


def _chain(q: float, length: int = 6) -> DraftTree:
    tree = DraftTree.chain(list(range(length)))
    tree.q = [q] * length
    return tree


def _pause_state(budget: LoadBudget) -> tuple:
    pauses = budget.pauses
    return pauses._paused, pauses._probing, pauses._pending, pauses._window_steps, pauses._window_gain


def test_a_probe_keeps_what_the_budget_would_and_at_least_the_best_node():
    budget = LoadBudget(max_nodes=8, half_life=1e9)
    weak, sure = _chain(0.05), _chain(0.99)
    assert [len(t) for t in budget.probe([weak, sure], ["a", "b"])] == [1, 1]  # no cost fit yet: the best node
    _feed_steps(budget, fixed=0.05, per_row=0.0005)
    budget.observe_drafting(1, 0.0001)
    assert [len(t) for t in budget.choose([weak, sure], ["a", "b"]).trees] == [0, 6]
    assert [len(t) for t in budget.probe([weak, sure], ["a", "b"])] == [1, 6]


def test_a_probe_leaves_the_pause_control_as_it_was():
    budget = LoadBudget(max_nodes=8, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.0005)
    budget.pauses._pause()
    while budget.pauses._paused > 1:
        assert not budget.begin_step().drafts
    assert not budget.begin_step().drafts  # the last paused step: the next one probes
    before = _pause_state(budget)
    budget.probe([_chain(0.9)], ["a"])
    budget.observe_tree(_chain(0.9), [0, 1, 2], "a")
    assert _pause_state(budget) == before
    assert budget.begin_step().probing


def test_uniform_steps_probe_only_at_a_width_that_pays_once_the_batch_is_measured():
    """A uniform step's width is every decoding request's: before the
    batch's draft-free step is measured, a probe is one node (the linear
    model's cold start); after, the best width's nodes, none where none pays."""
    table = StepCostTable(batch_sizes=(4,), half_life=1.0)
    budget = shape_budget(16, (2,), table)
    sure, weak = _chain(0.99, 12), _chain(0.05, 3)
    assert [len(t) for t in budget.probe([sure, weak], ["a", "b"], plain=2)] == [1, 1]
    table.observe(4, 1, 0.010)
    table.observe(4, 3, 0.040)  # width 2 costs four plain steps: no probe pays
    assert [len(t) for t in budget.probe([sure, weak], ["a", "b"], plain=2)] == [0, 0]
    for _ in range(8):
        table.observe(4, 3, 0.011)  # now it does
    assert [len(t) for t in budget.probe([sure, weak], ["a", "b"], plain=2)] == [2, 2]


def _retrieval_proposer():
    proposer = proposer_for(TreeConfig("retrieval", "retrieval", 8, {"l_max": 2}))
    proposer.load_budget.pauses._paused = 100
    return proposer


TOKENS = np.array([[5, 6, 4, 4, 5, 6, 4, 5], [1, 2, 3, 1, 2, 3, 1, 2], [9, 8, 7, 6, 5, 4, 3, 2]])


def test_while_paused_only_requests_never_verified_draft():
    proposer = _retrieval_proposer()
    ids, sampled, lengths = ["a", "b", "c"], [[5], [2], [2]], np.array([8, 8, 8])
    proposer.observe(["b"], [_chain(0.5, 2)], [[0]])  # b has had a tree verified
    assert not proposer.begin_step().drafts
    drafts = proposer.propose_trees(ids, sampled, lengths, TOKENS, [True] * 3, PAUSED)
    assert len(drafts[0]) >= 1 and drafts[1] == [] and drafts[2] == []  # c's context has no match
    assert proposer.stats.newcomer_probes == 1 and proposer.load_budget.drafted_requests == 2.0
    proposer.observe(["a"], [proposer.trees["a"]], [[]])  # rejected, but verified: a waits now
    drafts = proposer.propose_trees(ids, sampled, lengths, TOKENS, [True] * 3, PAUSED)
    assert drafts == [[], [], []] and proposer.stats.newcomer_probes == 1


def test_control_steps_and_ineligible_requests_get_no_probe():
    proposer = _retrieval_proposer()
    ids, sampled, lengths = ["a", "b"], [[5], [2]], np.array([8, 8])
    control = StepDecision(drafts=False, control=True)
    assert proposer.propose_trees(ids, sampled, lengths, TOKENS[:2], [True, True], control) == [[], []]
    assert proposer.propose_trees(ids, sampled, lengths, TOKENS[:2], [False, True], PAUSED)[0] == []
    assert proposer.stats.newcomer_probes == 1  # b


def test_a_finished_or_preempted_request_leaves_nothing_behind():
    proposer = _retrieval_proposer()
    proposer.propose_trees(["a"], [[5]], np.array([8]), TOKENS[:1], [True], PAUSED)
    proposer.observe(["a"], [proposer.trees["a"]], [[0]])
    assert proposer.requests_held()["trees"] == 1
    proposer.forget(["a"], finished=["a"])
    assert proposer.requests_held() == {"trees": 0, "drafter": 0, "policy": 0, "load_budget": 0}


def test_with_every_node_verified_there_is_no_pause_and_no_probe():
    proposer = proposer_for(TreeConfig("retrieval", "retrieval", 8, {"l_max": 2}, load_budget="fixed"))
    assert proposer.load_budget is None and proposer.begin_step().drafts
    assert proposer.propose_trees(["a"], [[5]], np.array([8]), TOKENS[:1], [True], PAUSED) == [[]]
