"""The load budget over the cost model of uniform steps (no engine): the
measured cost of each step shape, the width of the best expected rate, and
the load budget's floor and pauses, the same code as over the line."""

import itertools

import numpy as np
import pytest

from vllm_adaptive_spec.budget.cost_fit import StepCostFit
from vllm_adaptive_spec.budget.cost_models import LinearCost, ShapeCost, best_width
from vllm_adaptive_spec.budget.cost_table import StepCostTable
from vllm_adaptive_spec.budget.load_budget import LoadBudget
from vllm_adaptive_spec.trees.tree import DraftTree

WIDTHS = (2, 4, 8, 16)


def shape_budget(max_nodes: int, widths: tuple[int, ...], table: StepCostTable, half_life: float = 200.0,
                 **kwargs) -> LoadBudget:
    """The load budget of uniform steps: over the measured shapes, the line until they are known."""
    return LoadBudget(max_nodes, ShapeCost(widths, table, LinearCost(StepCostFit(half_life))), half_life=half_life,
                      **kwargs)


def test_cells_are_keyed_by_the_padded_batch_and_follow_their_own_measurements():
    table = StepCostTable(batch_sizes=(1, 2, 4, 8), half_life=1.0)
    table.observe(5, 3, 0.010)  # batch 5 replays the graph of batch 8
    assert table.measured(8, 3) == table.measured(7, 3) == pytest.approx(0.010)
    table.observe(8, 3, 0.020)
    assert table.measured(8, 3) == pytest.approx((0.5 * 0.010 + 0.020) / 1.5)
    assert table.measured(4, 3) is None and table.padded(9) == 9  # beyond the largest size: as it is


def test_an_unmeasured_width_costs_what_the_widest_narrower_measured_step_does():
    table = StepCostTable()
    table.observe(8, 1, 0.004)
    table.observe(8, 5, 0.005)
    assert table.cost(8, 9) == pytest.approx(0.005) and table.cost(8, 3) == pytest.approx(0.004)
    assert table.cost(8, 1) == pytest.approx(0.004) and table.cost(16, 5) is None


def test_the_best_width_is_the_best_over_every_width():
    rng = np.random.default_rng(0)
    for _ in range(200):
        p_hat = [np.sort(rng.random(int(rng.integers(0, 17))))[::-1] for _ in range(int(rng.integers(1, 6)))]
        plain = int(rng.integers(0, 4))
        costs = {1 + w: float(rng.uniform(0.9, 2.0)) for w in (0, *WIDTHS)}
        width, rate = best_width(p_hat, plain, WIDTHS, costs.get)
        rates = {w: (len(p_hat) + plain + sum(v[:w].sum() for v in p_hat)) / costs[1 + w] for w in (0, *WIDTHS)}
        assert rate == pytest.approx(max(rates.values())) and rates[width] == pytest.approx(rate)


def test_widths_of_unknown_cost_are_not_chosen():
    p_hat = [np.ones(16)]
    assert best_width(p_hat, 0, WIDTHS, {1: 1.0, 3: 1.0}.get) == (2, 3.0)


def chain(q: list[float]) -> DraftTree:
    tree = DraftTree.chain(list(range(1, len(q) + 1)))
    tree.q = q
    return tree


def measured_budget(costs: dict[int, float], **kwargs) -> LoadBudget:
    table = StepCostTable()
    for rows, seconds in costs.items():
        table.observe(8, rows, seconds)
    return shape_budget(16, WIDTHS, table, half_life=1e9, **kwargs)


def test_within_the_width_padding_is_free_so_unlikely_nodes_are_kept():
    """Rows are nearly free up to 9 a request and dear beyond: every tree
    keeps its 8 best nodes, however unlikely its last ones, and no more."""
    budget = measured_budget({1: 0.010, 3: 0.0101, 5: 0.0102, 9: 0.0104, 17: 0.030})
    trees = [chain([0.9] * 4 + [0.2] * 8)] * 8
    budget.observe_drafting(8, 0.001)
    assert [len(tree) for tree in budget.choose(trees, plain=0).trees] == [8] * 8
    # The linear model over the same steps would keep few of them: a row there costs its share of the step.
    linear = LoadBudget(16, half_life=1e9)
    for rows, seconds in itertools.islice(itertools.cycle([(8, 0.010), (24, 0.0101), (40, 0.0102), (72, 0.0104),
                                                           (136, 0.030)]), 40):
        linear.fit.observe(rows, seconds)
    linear.observe_drafting(8, 0.001)
    assert sum(len(tree) for tree in linear.choose(trees).trees) < 64


def test_until_the_draft_free_step_is_measured_the_linear_budget_chooses():
    budget = shape_budget(16, WIDTHS, StepCostTable(), half_life=1e9)
    reference = LoadBudget(16, half_life=1e9)
    trees = [chain([0.9, 0.5, 0.2])] * 4
    assert budget.choose(trees).trees == reference.choose(trees).trees


def test_no_node_below_the_floor_is_kept():
    budget = measured_budget({1: 0.010, 17: 0.0101})
    for rows in range(8, 48):
        budget.fit.observe(rows, 0.01 + 0.0005 * rows)
    floor = budget.floor(8)
    assert floor > 0
    trees = [chain([0.9, floor / 2, 0.9])] * 8
    budget.observe_drafting(8, 0.001)
    assert [len(tree) for tree in budget.choose(trees, floor=floor).trees] == [1] * 8


def test_trees_that_never_pay_their_width_pause_drafting():
    """Every width costs far more than its trees return: no node is kept,
    and after losing steps drafting pauses, for longer and longer."""
    budget = measured_budget({1: 0.010, 3: 0.030, 5: 0.050, 9: 0.090, 17: 0.170}, pause_after=4, pause_steps=4,
                             max_pause=64)
    weak = [chain([0.2] * 3)] * 8
    drafted = []
    for _ in range(200):
        drafted.append(budget.begin_step().drafts)
        if drafted[-1]:
            budget.observe_drafting(8, 0.004)
            assert budget.choose(weak).trees == [DraftTree()] * 8
    assert sum(drafted[-100:]) <= 2
