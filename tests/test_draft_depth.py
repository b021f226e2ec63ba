"""The draft side of the load budget: how many passes a model drafter's step
runs, from the measured cost of a pass and what each depth's kept nodes bring."""

import numpy as np
import pytest

from vllm_adaptive_spec.budget.draft_depth import EXPLORE, DraftDepth, kept_by_depth, shape_of
from vllm_adaptive_spec.budget.load_budget import LoadBudget
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree

PLAIN_STEP, ROW = 0.040, 0.001  # a verify step's fixed cost and a row's, seconds


def verify(nodes: float, depth: int) -> float:
    return PLAIN_STEP + ROW * (1 + nodes)


def measured(first: float, layer: float, gains, nodes, requests: int = 1, limit: int = 4, steps: int = 40):
    """A depth decision that has seen steps of every depth up to ``limit``:
    drafting ``first + layer * (d - 1)`` seconds, and per request ``gains[k]``
    expected tokens from ``nodes[k]`` kept nodes at depth ``k + 1``."""
    decision = DraftDepth()
    gains, nodes = np.asarray(gains, dtype=float), np.asarray(nodes, dtype=float)
    for step in range(steps):
        depth = 1 + step % limit
        decision.observe_drafting(requests, first + layer * (depth - 1), depth)
        decision.observe_kept(requests, gains[:depth] * requests, nodes[:depth] * requests)
    return decision


def rate(depth: int, first: float, layer: float, gains, nodes) -> float:
    return (1 + sum(gains[:depth])) / (verify(sum(nodes[:depth]), depth) + first + layer * (depth - 1))


def chosen(decision: DraftDepth, limit: int = 4, requests: int = 1) -> int:
    """The depth chosen on a step that is not an exploring one."""
    record = decision._record(requests)
    if (record.steps + 1) % EXPLORE == 0:
        record.steps += 1
    return decision.choose(requests, 0, limit, verify)


def test_a_pass_dearer_than_its_layer_s_gain_stops_growth_at_one_pass():
    """A head whose deeper layers bring little, at a pass that costs half a
    verify step: the one-pass tree (the root's children only) is the best."""
    gains, nodes = [0.6, 0.3, 0.15, 0.08], [4, 4, 4, 4]
    decision = measured(first=0.005, layer=0.020, gains=gains, nodes=nodes)
    assert chosen(decision) == 1
    assert rate(1, 0.005, 0.020, gains, nodes) > max(rate(d, 0.005, 0.020, gains, nodes) for d in (2, 3, 4))


def test_nearly_free_passes_grow_the_policy_s_whole_depth():
    gains, nodes = [0.8, 0.7, 0.6, 0.5], [1, 1, 1, 1]
    decision = measured(first=0.0005, layer=0.0005, gains=gains, nodes=nodes)
    assert chosen(decision) == 4


def test_the_depth_is_where_the_next_layer_stops_paying():
    """Each layer's gain halves; the chosen depth is the argmax of the rate."""
    gains, nodes = [0.9, 0.45, 0.22, 0.11, 0.05, 0.03], [1] * 6
    first, layer = 0.004, 0.006
    decision = measured(first, layer, gains, nodes, limit=6)
    best = max(range(1, 7), key=lambda d: rate(d, first, layer, gains, nodes))
    assert 1 < best < 6
    assert chosen(decision, limit=6) == best


def test_unmeasured_shapes_and_depths_grow_the_policy_s_whole_depth():
    decision = DraftDepth()
    assert decision.choose(1, 0, 5, verify) == 5  # nothing measured
    decision = measured(0.005, 0.020, [0.6, 0.3], [4, 4], limit=2)
    assert chosen(decision, limit=2) == 1
    assert decision.choose(1, 0, 3, verify) == 3  # depth 3 never grown: its gain is not guessed
    assert decision.choose(8, 0, 2, verify) == 2  # another batch shape: nothing measured there
    assert decision.choose(1, 0, 2, None) == 2  # the cost model does not know the step yet


def test_one_drafting_step_in_explore_grows_a_layer_deeper():
    decision = measured(0.005, 0.020, [0.6, 0.3, 0.15, 0.08], [4, 4, 4, 4])
    depths = [decision.choose(1, 0, 4, verify) for _ in range(2 * EXPLORE)]
    assert sorted(depths) == [1] * (2 * EXPLORE - 2) + [2, 2]
    assert decision.choices[1] == 2 * EXPLORE - 2 and decision.choices[2] == 2


def test_the_drafting_line_splits_the_first_pass_from_a_layer():
    decision = measured(first=0.010, layer=0.003, gains=[0.5] * 4, nodes=[1] * 4)
    record = decision._record(1)
    assert record.drafting_seconds(1) == pytest.approx(0.010)
    assert record.drafting_seconds(4) == pytest.approx(0.019)
    single = DraftDepth()
    for _ in range(5):  # one depth only: a layer costs its share of the step
        single.observe_drafting(1, 0.012, 3)
    assert single._record(1).drafting_seconds(1) == pytest.approx(0.004)
    assert single._record(1).drafting_seconds(3) == pytest.approx(0.012)


def test_batch_shapes_are_powers_of_two():
    assert [shape_of(n) for n in (1, 2, 3, 4, 5, 8, 9, 64)] == [1, 2, 4, 4, 8, 8, 16, 64]


def test_kept_by_depth_sums_each_depth_s_calibrated_path_probabilities():
    wide = DraftTree([1, 2, 3], [ROOT, ROOT, 0], [0.5, 0.25, 0.5])
    chain = DraftTree([4, 5], [ROOT, 0], [0.8, 0.5])
    gains, nodes = kept_by_depth([wide, chain, DraftTree()], [1.0, 2.0, 1.0], 3)
    assert gains.tolist() == pytest.approx([0.75 + 1.6, 0.25 + 0.8, 0.0])
    assert nodes.tolist() == [3, 2, 0]


def _budget_with_a_fit(branch_seconds: float = 0.0) -> LoadBudget:
    """A load budget whose step-cost line is known: 40 ms a step, 1 ms a row,
    ``branch_seconds`` a branching tree."""
    budget = LoadBudget(16)
    for step in range(40):
        rows, trees, branching = 1 + step % 5, step % 2, step % 4 == 0
        budget.cost.observe(rows, PLAIN_STEP + ROW * rows + branch_seconds * branching, 0, trees or branching,
                            int(branching))
    return budget


def test_the_load_budget_drafts_one_pass_where_passes_do_not_pay():
    budget = _budget_with_a_fit()
    assert budget.draft_depth(1, 0, 4) == 4  # nothing drafted yet: the policy's depth
    wide = DraftTree([1, 2, 3, 4, 5], [ROOT, ROOT, ROOT, 0, 3], [0.5, 0.3, 0.15, 0.3, 0.3])
    for step in range(24):
        depth = 1 + step % 4
        budget.observe_drafting(1, 0.004 + 0.020 * (depth - 1), depth)
        grown = wide.subset([i for i, d in enumerate(wide.depths()) if d <= depth])
        budget.choose([grown], ["r"], grown_depth=depth, passes=depth)
    steps = [budget.draft_depth(1, 0, 4) for _ in range(EXPLORE - 1)]
    assert min(steps) == 1 and steps.count(1) >= EXPLORE - 2


@pytest.mark.parametrize("branch_seconds, branches", [(0.0, True), (0.020, False)])
def test_the_load_budget_grows_a_chain_deep_where_branching_does_not_pay(branch_seconds, branches):
    """Where branching trees cost 20 ms more (a chain runs in vLLM's own
    attention on the CPU), the budget verifies the main path only; where
    they cost nothing more, the second child of the root is kept too. The
    depth drafted is the tree's best either way: passes are nearly free."""
    budget = _budget_with_a_fit(branch_seconds)
    tree = DraftTree([1, 2, 3, 4, 5], [ROOT, ROOT, 0, 2, 3], [0.6, 0.3, 0.9, 0.9, 0.9])
    for step in range(24):
        depth = 1 + step % 4
        budget.observe_drafting(1, 0.001 * depth, depth)
        grown = tree.subset([i for i, d in enumerate(tree.depths()) if d <= depth])
        kept = budget.choose([grown], ["r"], grown_depth=depth, passes=depth).trees[0]
        assert kept.branches() == branches
    assert [budget.draft_depth(1, 0, 4) for _ in range(EXPLORE - 1)].count(4) >= EXPLORE - 2


def test_a_step_is_judged_at_its_own_depth_s_drafting_cost():
    """After steps of the policy's whole depth (8 passes, 64 ms), a one-pass
    step is costed at one pass (a layer's share of those steps), not at the
    mean over deep steps, which would have it judged a loss and paused."""
    budget = LoadBudget(16)
    for _ in range(4):
        budget.observe_drafting(1, 0.064, 8)
    assert budget.draft_cost() == pytest.approx(0.064)
    assert budget.draft_cost(1, 8) == pytest.approx(0.064)
    assert budget.draft_cost(1, 1) == pytest.approx(0.008)
    assert budget.draft_cost(8, 1) == pytest.approx(0.064)  # nothing measured at 8 requests: the mean
    budget.observe_drafting(1, 0.010, 1)
    assert budget.draft_cost(1, 1) == pytest.approx(0.010, abs=1e-9)  # two depths: the line splits them


def test_depths_the_floor_stopped_growth_short_of_count_as_measured():
    """Growth allowed 4 layers stopped after 2 (nothing above the floor
    below them): depths 3 and 4 kept nothing, which is a measurement, so
    the next step's depth is chosen, not the policy's whole depth again."""
    budget = _budget_with_a_fit()
    tree = DraftTree([1, 2], [ROOT, 0], [0.5, 0.4])
    for _ in range(4):
        budget.observe_drafting(1, 0.004 + 0.020, 2)
        budget.choose([tree], ["r"], grown_depth=4, passes=2)
    assert budget.depth._record(1).measured_depths() >= 4
    assert budget.draft_depth(1, 0, 4) < 4
