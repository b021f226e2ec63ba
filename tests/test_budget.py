"""The load budget (no engine): the allocation over the batch on synthetic
costs and acceptances, the online cost and calibration estimates, and the
pause of drafting when speculation never pays."""

import copy
import random

import numpy as np
import pytest
from test_tree import random_bfs_tree

from vllm_adaptive_spec.budget.cost_fit import BRANCHING, PRIOR_STEPS, StepCostFit, solve_spd
from vllm_adaptive_spec.budget.load_budget import COLD_TRIALS, LoadBudget
from vllm_adaptive_spec.budget.node_allocation import allocate
from vllm_adaptive_spec.trees.tree import DraftTree


def _rate(p_hat, kept, fixed, per_row, plain=0):
    batch = len(p_hat) + plain
    gain = batch + sum(float(np.sum(v[:k])) for v, k in zip(p_hat, kept))
    return gain / (fixed + per_row * (batch + sum(kept)))


def test_allocation_is_the_best_over_every_choice():
    """Exhaustive check on small batches: no other split of nodes among the
    requests (each keeping a prefix of its descending list) has a higher rate."""
    rng = np.random.default_rng(0)
    for _ in range(200):
        batch = int(rng.integers(1, 4))
        p_hat = [np.sort(rng.random(int(rng.integers(0, 5))))[::-1] for _ in range(batch)]
        fixed, per_row, plain = float(rng.random()), float(rng.random() * 0.3), int(rng.integers(0, 5))
        kept = allocate(p_hat, fixed, per_row, plain=plain)
        best = max(
            _rate(p_hat, choice, fixed, per_row, plain)
            for choice in np.ndindex(*[len(v) + 1 for v in p_hat])
        )
        assert _rate(p_hat, kept, fixed, per_row, plain) == pytest.approx(best)


def test_confident_requests_get_more_nodes():
    p_hat = [np.array([0.95, 0.9, 0.85, 0.8]), np.array([0.3, 0.1, 0.05, 0.01])]
    assert allocate(p_hat, fixed=0.2, per_row=0.01) == [4, 1]


def test_nodes_shrink_with_load_down_to_none():
    p = np.array([0.9, 0.7, 0.5, 0.3, 0.2, 0.1, 0.05])
    totals = [sum(allocate([p] * batch, fixed=0.2, per_row=0.002)) / batch for batch in (1, 8, 64, 2048)]
    assert totals == sorted(totals, reverse=True)
    assert totals[0] == 7 and totals[-1] == 0


def test_every_node_kept_when_verification_is_free():
    p = [np.array([0.5, 0.2, 0.01])] * 3
    assert allocate(p, fixed=0.05, per_row=0.0, plain=100) == [3, 3, 3]


def _feed_steps(budget: LoadBudget, fixed: float, per_row: float, steps: int = 40) -> None:
    rng = np.random.default_rng(0)
    for _ in range(steps):
        tokens = int(rng.integers(4, 200))
        budget.fit.observe(tokens, fixed + per_row * tokens)


def test_cost_fit_recovers_a_linear_step_time():
    budget = LoadBudget(max_nodes=8)
    assert budget.fit.cost() is None
    _feed_steps(budget, fixed=0.02, per_row=0.001)
    fixed, per_row, per_prompt_token = budget.fit.cost()
    assert fixed == pytest.approx(0.02) and per_row == pytest.approx(0.001)
    assert per_prompt_token == per_row  # no prefill seen


def test_cost_fit_is_solved_again_after_each_new_step():
    fit = StepCostFit(half_life=1e9)
    for rows in range(1, 11):
        fit.observe(rows, 0.02 + 0.001 * rows)
    assert fit.cost() == pytest.approx((0.02, 0.001, 0.001))
    for rows in range(1, 11):  # the same rows now cost twice as much; the fit moves toward it
        fit.observe(rows, 0.02 + 0.002 * rows)
    assert fit.cost()[1] == pytest.approx(0.0015)


def test_the_small_solve_matches_numpy_whatever_the_columns_units():
    """The fit's plain-Python Cholesky solve against numpy's, on systems
    whose columns differ in scale by up to a million, as the step's columns
    do (one, decode rows, prompt tokens, trees)."""
    rng = np.random.default_rng(5)
    for _ in range(200):
        n = int(rng.integers(1, 6))
        x = rng.random((40, n)) * 10.0 ** rng.integers(0, 7, n)
        gram, rhs = x.T @ x, x.T @ rng.random(40)
        got = solve_spd(gram.tolist(), rhs.tolist())
        assert got == pytest.approx(np.linalg.solve(gram, rhs).tolist(), rel=1e-6)


def test_a_column_that_repeats_another_leaves_the_fit():
    """Every step verified one tree: the trees column is the constant column
    again, so the system is degenerate and the fit leaves that column out
    (``per_tree`` 0, ``fixed`` holding the tree's cost); one step in 100
    without a tree is enough to tell them apart."""
    x = np.column_stack([np.ones(100), np.arange(1, 101) % 9 + 1, np.ones(100)])
    assert solve_spd((x.T @ x).tolist(), (x.T @ np.ones(100)).tolist()) is None
    fit = StepCostFit(half_life=1e9)
    for rows in range(1, 41):
        fit.observe(rows + 1, 0.03 + 0.002 * (rows + 1) + 0.005, trees=1)
    assert fit.tree_cost() == 0.0 and fit.cost()[0] == pytest.approx(0.035)
    fit.observe(2, 0.03 + 0.002 * 2)
    assert fit.tree_cost() == pytest.approx(0.005) and fit.cost()[0] == pytest.approx(0.03)


def test_the_fit_is_the_decayed_least_squares_of_its_steps():
    """Every column seen and told apart: the fit is numpy's solution of the
    decayed normal equations with the branching column's prior."""
    rng = np.random.default_rng(6)
    fit, decay = StepCostFit(half_life=50), 0.5 ** (1 / 50)
    gram, moment = np.zeros((5, 5)), np.zeros(5)
    for _ in range(300):
        rows, prefill, trees = int(rng.integers(1, 40)), int(rng.choice([0, 0, 0, 512])), int(rng.integers(0, 5))
        branching = int(rng.integers(0, trees + 1))
        seconds = 0.03 + 0.002 * rows + 0.0002 * prefill + 0.001 * trees + 0.002 * branching + rng.normal(0, 1e-3)
        fit.observe(rows + prefill, seconds, prefill, trees, branching)
        x = np.array([1.0, rows, prefill, trees, branching])
        gram, moment = gram * decay + np.outer(x, x), moment * decay + x * seconds
    expected = np.linalg.solve(gram + np.diag([0.0] * BRANCHING + [PRIOR_STEPS]), moment)
    assert list(fit.solve()) == pytest.approx(expected.tolist(), rel=1e-6)


def test_cost_fit_tells_prompt_tokens_from_decode_rows():
    """Prompt chunks are cheaper per token than decode rows; one slope for
    both would understate what a tree node costs."""
    budget = LoadBudget(max_nodes=8)
    rng = np.random.default_rng(1)
    for _ in range(60):
        rows, prefill = int(rng.integers(1, 40)), int(rng.choice([0, 0, 300, 900]))
        budget.fit.observe(rows + prefill, 0.03 + 0.004 * rows + 0.0002 * prefill, prefill)
    assert budget.fit.cost() == pytest.approx((0.03, 0.004, 0.0002))


def test_a_trees_fixed_cost_is_fitted_and_only_confident_trees_pay_it():
    """Verifying a tree costs per_tree beyond its rows: the fit separates it from
    the per-row cost, and a tree whose nodes return less than per_tree is not
    verified while a confident one keeps all its nodes."""
    budget = LoadBudget(max_nodes=8, half_life=1e9)
    rng = np.random.default_rng(2)
    for _ in range(80):
        trees = int(rng.integers(0, 5))
        rows = 4 + trees * int(rng.integers(1, 9))
        budget.fit.observe(rows, 0.05 + 0.002 * rows + 0.03 * trees, 0, trees)
    assert budget.fit.cost() == pytest.approx((0.05, 0.002, 0.002))
    assert budget.fit.tree_cost() == pytest.approx(0.03)
    confident = DraftTree.chain([1, 2, 3])
    confident.q = [0.95, 0.95, 0.95]
    weak = DraftTree.chain([4, 5, 6])
    weak.q = [0.3, 0.3, 0.3]  # p = .3, .09, .03: less than per_tree's worth of tokens
    assert budget.choose([confident, weak]).trees == [confident, DraftTree()]
    assert LoadBudget(max_nodes=8).fit.tree_cost() == 0.0  # unknown before any step


def test_calibration_discounts_an_optimistic_drafter():
    budget = LoadBudget(max_nodes=8, half_life=1e9)
    chain = DraftTree.chain([1, 2, 3, 4])  # q = 1: predicted 4 accepted nodes per tree
    for _ in range(50):
        budget.observe_tree(chain, [0])  # one accepted
    assert budget.calibration() == pytest.approx(51 / 201)


def test_cold_start_keeps_only_likely_nodes():
    budget = LoadBudget(max_nodes=8, cold_min_p=0.3)
    tree = DraftTree([5, 6, 7], [-1, 0, -1], [0.9, 0.5, 0.2])  # p: .9 .45 .2
    assert budget.choose([tree]).trees == [DraftTree([5, 6], [-1, 0], [0.9, 0.5])]


def _weak_drafting(budget: LoadBudget, q: float, seconds: float, step=lambda: None) -> list[bool]:
    """200 steps of 8 requests whose 3-node chains (each node ``q``) are never
    worth a row, drafting taking ``seconds``; whether each step drafted. Before
    the fit is known, the cold start's trials verify each chain's first node."""

    weak = DraftTree.chain([1, 2, 3])
    weak.q = [q] * 3
    drafted = []
    for _ in range(200):
        step()
        drafted.append(budget.begin_step().drafts)
        if drafted[-1]:
            budget.observe_drafting(8, seconds)
            trial = budget.fit.solve() is None and budget.cold_trials < COLD_TRIALS
            assert budget.choose([weak] * 8).trees == [weak.prefix(1) if trial else DraftTree()] * 8
    return drafted


def test_speculation_that_never_pays_settles_on_no_drafting():
    """Every node costs more than it returns: nothing is verified, and after
    steps whose drafting did not pay, drafting pauses for longer and longer."""
    budget = LoadBudget(max_nodes=16, pause_after=4, pause_steps=4, max_pause=64, half_life=1e9)
    _feed_steps(budget, fixed=0.01, per_row=0.01)
    drafted = _weak_drafting(budget, q=0.2, seconds=0.004)
    assert sum(drafted[-100:]) <= 2, "drafting should be paused almost always"
    # After the first pause, each look at drafting is a single probe step.
    after_first_pause = drafted[drafted.index(False):]
    runs = "".join("d" if d else "." for d in after_first_pause).split(".")
    assert max(len(run) for run in runs) == 1, runs


def test_drafting_that_never_yields_a_node_pauses_before_the_cost_fit_is_known():
    """Every step decodes the same rows (no tree was ever verified, so the
    step-cost fit cannot tell the fixed cost from a row's), and the drafter's
    trees hold no node worth verifying: its drafting is pure loss, measured
    against the step time alone, so drafting pauses (and is not probed
    again every step)."""
    budget = LoadBudget(max_nodes=32, pause_after=4, pause_steps=4, max_pause=64, half_life=1e9)
    drafted = _weak_drafting(budget, q=0.1, seconds=0.02, step=lambda: budget.fit.observe(8, 0.03))
    assert budget.fit.solve() is None
    assert sum(drafted[-100:]) <= 3, "drafting should be paused almost always"


def test_a_cold_start_that_keeps_nodes_is_not_judged_before_the_fit_is_known():
    """Nodes kept before the fit is known are a trial (their verification
    makes the fit solvable), so those steps neither pause nor leave a probe open."""
    budget = LoadBudget(max_nodes=8, pause_after=1, half_life=1e9)
    likely = DraftTree.chain([1, 2])
    likely.q = [0.9, 0.9]
    for _ in range(20):
        budget.fit.observe(8 + 16, 0.03)  # every step the same shape: the fit stays unknown
        decision = budget.begin_step()
        assert decision.drafts and not decision.probing
        budget.observe_drafting(8, 0.05)
        assert budget.choose([likely] * 8).trees == [likely] * 8


def test_a_fit_in_which_no_step_costs_anything_is_not_used():
    """A handful of noisy steps can solve to no fixed cost and no row cost
    (all the time put on prompt tokens and trees); rates would divide by zero.
    Such a solution is not used: a fit with fewer columns, or none (the
    cautious cold default)."""
    budget = LoadBudget(max_nodes=16)
    for rows, prefill, trees in [(1, 64, 0), (2, 0, 1), (3, 64, 1), (4, 0, 1), (2, 64, 0), (3, 0, 1), (1, 64, 1),
                                 (4, 64, 0), (1, 0, 1)]:
        seconds = 0.0005 * prefill + 0.03 * trees - 0.002 - 0.001 * rows  # more rows, less time: fits to 0, 0
        budget.fit.observe(rows + prefill, seconds, prefill, trees, 0)
    solution = budget.fit.solve()  # the fit without the trees column, or None
    assert solution is None or solution[0] + solution[1] > 0, solution
    tree = DraftTree.chain([1, 2])
    tree.q = [0.9, 0.9]
    floor = budget.floor(1)
    budget.observe_drafting(1, 0.0)
    budget.choose([tree], floor=floor)


def test_a_trees_own_cost_is_told_from_the_fixed_cost_by_control_steps():
    """Batch 1 with a tree on every step: without tree-less steps the fit reads
    a tree's own cost as fixed cost, so a step without drafting looks dearer
    than it is (the drafter looks better). The budget's control steps (at
    most one in ``CONTROL_GAP`` while the trees per step hardly vary) give the
    fit what it needs; the true costs are recovered, at a price of a few
    percent of the steps."""
    rng = np.random.default_rng(0)
    fixed, per_row, per_tree = 0.016, 0.0006, 0.004

    def run(controls: bool) -> tuple[list[float], int]:
        budget = LoadBudget(max_nodes=8, half_life=200)
        skipped = 0
        for _ in range(400):
            drafting = budget.begin_step().drafts if controls else True
            skipped += not drafting
            trees = int(drafting)
            rows = 1 + (int(rng.integers(1, 9)) if drafting else 0)
            budget.fit.observe(rows, fixed + per_row * rows + per_tree * trees + rng.normal(0, 2e-4), 0, trees, 0)
        return budget.fit.solve(), skipped

    blind, _ = run(controls=False)
    assert blind[0] > fixed + 0.75 * per_tree  # the tree's cost read as fixed cost
    fitted, skipped = run(controls=True)
    assert fitted[0] == pytest.approx(fixed, rel=0.1) and fitted[3] == pytest.approx(per_tree, rel=0.2), fitted
    assert skipped <= 400 * 0.04, skipped


def test_no_control_step_where_the_trees_per_step_vary_on_their_own():
    """Retrieval trees at batch 32: some requests draft, some do not."""
    rng = np.random.default_rng(1)
    budget = LoadBudget(max_nodes=16, half_life=200)
    for _ in range(400):
        assert budget.begin_step().drafts
        trees = int(rng.integers(4, 28))
        rows = 32 + trees * 3
        budget.fit.observe(rows, 0.05 + 0.0006 * rows + 0.001 * trees, 0, trees, 0)


def test_drafting_that_costs_far_more_than_a_step_pauses_at_once():
    """A draft model whose trees cost ten plain steps: the first drafting step
    pauses (not ``pause_after`` of them); a step that loses a little does not."""
    budget = LoadBudget(max_nodes=16, pause_after=16, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.001)
    weak = DraftTree.chain([1, 2, 3])
    weak.q = [0.2, 0.2, 0.2]
    budget.observe_drafting(16, 16 * 0.03)  # 0.48 s of drafting for a 0.07 s step
    budget.choose([weak] * 16).trees
    assert not budget.begin_step().drafts
    cheap = LoadBudget(max_nodes=16, pause_after=16, half_life=1e9)
    _feed_steps(cheap, fixed=0.05, per_row=0.001)
    cheap.observe_drafting(16, 16 * 0.0005)
    cheap.choose([weak] * 16).trees
    assert cheap.begin_step().drafts


def _first_pause(seconds: float) -> int:
    """Steps of the first pause of a drafter whose 16 trees of unlikely nodes
    take ``seconds`` to draft, a plain step taking 0.066 s."""
    budget = LoadBudget(max_nodes=16, pause_after=16, pause_steps=16, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.001)
    weak = DraftTree.chain([1, 2, 3])
    weak.q = [0.01, 0.01, 0.01]
    while budget.begin_step().drafts:
        budget.observe_drafting(16, seconds)
        budget.choose([weak] * 16).trees
    paused = 1
    while not budget.begin_step().drafts:
        paused += 1
    return paused


def test_a_drafter_whose_probe_costs_many_steps_is_probed_rarely():
    """A pause lasts until one more drafting step like the last costs at most
    1% of the paused time: a draft LM whose trees take 16 plain steps to
    draft (the probe of a depth-18 EAGLE-2 tree at batch 8 on the CPU) is
    paused for 1,600 steps, not the doubling schedule's 16; a drafter
    spending a tenth of a step keeps the schedule."""
    assert abs(_first_pause(16 * 0.066) - 1600) <= 1
    assert _first_pause(0.0066) == 16
    assert _first_pause(1000.0) == 8192  # max_probe_pause


def _verify(budget: LoadBudget, chosen: list[DraftTree], accepted: int | None = None) -> None:
    """The engine's verification of the chosen chains: each accepts its first
    ``accepted`` nodes (all of them when None)."""
    for tree in chosen:
        if len(tree):
            budget.observe_tree(tree, list(range(len(tree)))[:accepted])


def _alternating(worth_trees: int) -> list[bool]:
    """Steps of 8 requests that alternate between ``worth_trees`` requests
    with a node worth verifying (``q`` 0.85, and accepted) and trees worth
    nothing, each step's drafting costing the same; whether each of 64 steps
    drafted."""
    budget = LoadBudget(max_nodes=8, pause_after=8, pause_steps=4, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.001)
    worth, weak = DraftTree.chain([1]), DraftTree.chain([2])
    worth.q, weak.q = [0.85], [0.1]
    drafted = []
    for step in range(64):
        drafted.append(budget.begin_step().drafts)
        if drafted[-1]:
            floor = budget.floor(8)
            budget.observe_drafting(8, 8 * 0.0005)
            wins = worth_trees if step % 2 == 0 else 0
            _verify(budget, budget.choose([worth] * wins + [weak] * (8 - wins), floor=floor).trees)
    return drafted


def test_drafting_that_loses_on_balance_pauses_though_it_wins_every_other_step():
    """Every other step keeps one node that pays a little more than the
    step's drafting and its row (+3.6% committed), the steps between keep
    none and lose the drafting time (-6.5%): drafting loses on balance,
    never twice in a row. It pauses at the end of its first window; drafting
    that wins on balance (three such nodes, +22.7% every other step) never
    pauses."""
    losing = _alternating(worth_trees=1)
    assert all(losing[:8]) and not losing[8], losing[:16]
    assert all(_alternating(worth_trees=3)), "a net gain should keep drafting"


def _after_a_lucky_streak(accepted: list[int], realized: bool = True) -> list[bool]:
    """Batch 1: a 3-node chain (``p`` .8 .64 .51) whose calibration still
    carries a lucky streak (200 trees accepted in full: ``factor`` 1.54), so
    every step expects 4 tokens for 0.064 s (+150% over 0.041 s a token);
    the step commits ``1 + accepted[step % len(accepted)]``. Whether each of
    24 steps drafted."""
    budget = LoadBudget(max_nodes=8, pause_after=8, pause_steps=64, half_life=1e9, realized=realized)
    _feed_steps(budget, fixed=0.04, per_row=0.001)
    chain = DraftTree.chain([1, 2, 3])
    chain.q = [0.8, 0.8, 0.8]
    for _ in range(200):
        budget.observe_tree(chain, [0, 1, 2])
    drafted = []
    for step in range(24):
        drafted.append(budget.begin_step().drafts)
        if drafted[-1]:
            floor = budget.floor(1)
            budget.observe_drafting(1, 0.02)
            assert budget.choose([chain], floor=floor).trees == [chain]
            _verify(budget, [chain], accepted[step % len(accepted)])
    return drafted


def test_drafting_judged_by_what_it_commits_not_by_what_it_expects():
    """A drafter that expects +150% a step and commits 1.5 tokens a step in
    its 0.064 s (-4% against 0.041 s a token without drafting) loses: its
    first window pauses it. Committing 1.6 tokens a step (+2.5%) or 2 (+28%)
    it drafts on. A retrieval drafter's windows (``realized`` False) are
    judged on the expectation: the losing steps never pause it."""
    losing = _after_a_lucky_streak([1, 0])
    assert all(losing[:8]) and not any(losing[8:]), losing
    assert all(_after_a_lucky_streak([1, 1, 0, 1, 0]))
    assert all(_after_a_lucky_streak([1]))
    assert all(_after_a_lucky_streak([1, 0], realized=False))


def test_a_drafter_that_spends_nearly_nothing_is_not_paused_for_the_steps_it_keeps_nothing():
    """A retrieval trie at batch 1 where a row costs a fifth of a step: 15
    steps in 16 find nothing worth verifying and cost 0.1 ms of drafting
    (0.25% of the step), the 16th keeps one node, accepted (+60%). Judged
    by what drafting adds to each step, the empty steps cost next to nothing
    and it drafts on (a flat 5% of every step would sum to -18% a
    window and pause it)."""
    budget = LoadBudget(max_nodes=8, pause_after=16, half_life=1e9)
    _feed_steps(budget, fixed=0.032, per_row=0.008)
    match, nothing = DraftTree.chain([1]), DraftTree.chain([4])
    match.q, nothing.q = [0.9], [0.05]
    for step in range(64):
        assert budget.begin_step().drafts, step
        floor = budget.floor(1)
        budget.observe_drafting(1, 0.0001)
        chosen = budget.choose([match if step % 16 == 15 else nothing], floor=floor).trees
        assert [len(t) for t in chosen] == [int(step % 16 == 15)]
        _verify(budget, chosen)


def test_a_drafter_drafts_for_every_request_only_after_a_window_that_paid():
    """Slow start: from the start, and again after a pause, a drafting step
    drafts for at most ``probe_requests`` requests until a whole window has
    paid; drafting that loses its window never drafts for more."""
    budget = LoadBudget(max_nodes=8, pause_after=8, pause_steps=4, half_life=1e9, probe_requests=4)
    _feed_steps(budget, fixed=0.05, per_row=0.001)
    worth = DraftTree.chain([1])
    worth.q = [0.85]
    limits = []
    for _ in range(12):
        decision = budget.begin_step()
        assert decision.drafts
        limits.append(decision.limit)
        floor = budget.floor(4, plain=4)
        budget.observe_drafting(4, 4 * 0.0005)
        _verify(budget, budget.choose([worth] * 4, plain=4, floor=floor).trees)
    assert limits == [4] * 8 + [None] * 4, limits
    budget.pauses._pause()  # a later window lost
    decision = budget.begin_step()
    while not decision.drafts:
        decision = budget.begin_step()
    assert decision.probing and decision.limit == 4
    floor = budget.floor(4, plain=4)
    budget.observe_drafting(4, 4 * 0.0005)
    budget.choose([worth] * 4, plain=4, floor=floor)  # the probe pays; the window it opens has not yet
    decision = budget.begin_step()
    assert decision.drafts and decision.limit == 4

    losing = LoadBudget(max_nodes=8, pause_after=8, pause_steps=4, half_life=1e9, probe_requests=4)
    _feed_steps(losing, fixed=0.05, per_row=0.001)
    weak = DraftTree.chain([2])
    weak.q = [0.1]
    for _ in range(64):
        decision = losing.begin_step()
        if decision.drafts:
            assert decision.limit == 4
            losing.observe_drafting(4, 4 * 0.0005)
            losing.choose([weak] * 4, plain=4).trees


def test_losses_that_add_up_to_a_clear_loss_pause_before_the_window_ends():
    """Drafting whose trees keep nothing and whose time costs 15% of every
    step: the window's losses reach half a step (one clear loss) on its 4th
    step, which pauses, not the 16th."""
    budget = LoadBudget(max_nodes=8, pause_after=16, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.001)
    weak = DraftTree.chain([2])
    weak.q = [0.1]
    drafted = []
    for _ in range(8):
        drafted.append(budget.begin_step().drafts)
        if drafted[-1]:
            budget.observe_drafting(8, 8 * 0.00128)  # 8 / (0.058 + 0.0102) is 0.85 of 8 / 0.058
            budget.choose([weak] * 8).trees
    assert drafted == [True] * 4 + [False] * 4, drafted


def test_speculation_that_always_pays_keeps_the_full_tree():
    budget = LoadBudget(max_nodes=16, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.0005)
    budget.observe_drafting(1, 0.001)
    strong = DraftTree.chain(list(range(16)))
    strong.q = [0.97] * 16
    for _ in range(20):
        budget.observe_tree(strong, list(range(10)))  # calibrated: 10 of sum(p) = 10.9
    assert all(budget.begin_step().drafts for _ in range(50))
    assert budget.choose([strong] * 4).trees == [strong] * 4


def _fitted(branch_seconds: float) -> LoadBudget:
    """Steps of 0 to 4 trees, some branching, each branching one costing
    ``branch_seconds``: enough of them that the branching column's prior
    (``cost_fit.PRIOR_STEPS``) weighs under 5% beside them."""
    budget = LoadBudget(max_nodes=8, half_life=1e9)
    rng = np.random.default_rng(3)
    for _ in range(400):
        trees = int(rng.integers(0, 5))
        branching = int(rng.integers(0, trees + 1))
        rows = 4 + trees * int(rng.integers(1, 9))
        budget.fit.observe(rows, 0.05 + 0.0005 * rows + branch_seconds * branching, 0, trees, branching)
    return budget


def test_a_branching_trees_extra_cost_is_fitted_apart_from_its_rows():
    assert _fitted(0.02).fit.branch_cost() == pytest.approx(0.02, rel=0.05)
    assert _fitted(0.02).fit.cost() == pytest.approx((0.05, 0.0005, 0.0005), rel=0.05)
    assert _fitted(0.0).fit.branch_cost() == pytest.approx(0.0, abs=1e-9)
    assert LoadBudget(max_nodes=8).fit.branch_cost() == 0.0  # unknown before any step


def test_one_slow_branching_step_does_not_price_branching():
    """Batch 1, chains on most steps: the first branching tree's step is
    20 ms slower (a one-time cost, or noise). Read from that step alone,
    branching would cost 20 ms, and the budget would verify no branching tree
    again to learn otherwise; the column's prior keeps it near 0 until the
    steps say more, and a real cost of 5 ms a branching tree is then found."""
    rng = np.random.default_rng(4)
    fit = StepCostFit(half_life=200)

    def step(branching: int, extra: float = 0.0) -> None:
        rows = 1 + int(rng.integers(1, 17))
        fit.observe(rows, 0.04 + 0.001 * rows + 0.005 * branching + extra + rng.normal(0, 5e-4), 0, 1, branching)

    for _ in range(100):
        step(0)
    step(1, extra=0.02)
    assert fit.branch_cost() < 0.003, fit.solve()
    for _ in range(300):
        step(int(rng.random() < 0.3))
    assert fit.branch_cost() == pytest.approx(0.005, rel=0.2), fit.solve()


def test_branches_kept_only_when_they_pay_for_their_extra_cost():
    # Root children .8 and .5; the .8 child has a child .6 (p = .48).
    tree = DraftTree([1, 2, 3], [-1, -1, 0], [0.8, 0.5, 0.6])
    assert _fitted(0.0).choose([tree]).trees == [tree]  # free branching: the whole tree
    assert _fitted(0.001).choose([tree]).trees == [tree]  # cheap: the .5 branch pays
    assert _fitted(0.05).choose([tree]).trees == [DraftTree([1, 3], [-1, 0], [0.8, 0.6])]  # dear: main path only


def test_a_request_whose_trees_are_accepted_keeps_more_nodes_than_one_whose_trees_fail():
    budget = LoadBudget(max_nodes=8, half_life=1e9)
    _feed_steps(budget, fixed=0.05, per_row=0.004)
    tree = DraftTree.chain([1, 2, 3, 4, 5, 6])
    tree.q = [0.6] * 6  # p = .6, .36, .22, .13, .08, .05
    for _ in range(10):
        budget.observe_tree(tree, list(range(4)), "good")  # four of sum(p) = 1.43 accepted
        budget.observe_tree(tree, [], "poor")  # none
    good, poor, new = budget.choose([tree, tree, tree], ["good", "poor", "new"]).trees
    assert len(good) > len(new) > len(poor)
    assert budget.calibration("good") > budget.calibration() > budget.calibration("poor")
    budget.forget("good")
    assert budget.calibration("good") == budget.calibration()


def test_a_requests_record_fades_back_to_the_engines_while_it_is_not_verified():
    budget = LoadBudget(max_nodes=8, half_life=1e9, request_half_life=4.0)
    _feed_steps(budget, fixed=0.05, per_row=0.004)
    tree = DraftTree.chain([1, 2])
    for _ in range(10):
        budget.observe_tree(tree, [], "poor")
        budget.observe_tree(tree, [0, 1], "good")
    before = budget.calibration("poor")
    for _ in range(40):
        budget.choose([DraftTree()], ["poor"]).trees
    assert before < budget.calibration("poor") == pytest.approx(budget.calibration(), rel=1e-2)


def test_a_hybrid_model_that_pays_against_no_drafting_but_not_against_retrieval_alone_pauses():
    """The hybrid's model is judged against its retrieval trie alone (which
    drafts for free while the model is paused), not against no drafting, and
    the trie's trees are scored by the trie's own record."""

    def run(fallback: bool, trie: LoadBudget | None = None) -> int:
        """Steps drafted (of 8) before the budget pauses the model."""
        budget = LoadBudget(max_nodes=16, pause_after=4, half_life=1e9)
        _feed_steps(budget, fixed=0.04, per_row=0.002)
        budget.observe_drafting(8, 8 * 0.004)
        tree = DraftTree.chain([1, 2, 3])
        tree.q = [0.9, 0.9, 0.9]  # p: .9 .81 .73, all worth their rows
        for step in range(8):
            if not budget.begin_step().drafts:
                return step
            chosen = budget.choose([tree] * 8, fallback=[tree] * 8 if fallback else None, fallback_budget=trie).trees
            assert chosen == [tree] * 8
            _verify(budget, chosen, accepted=2)
        return 8

    # 8 trees expect 27.5 tokens and commit 24 in 0.136 s of step: far above 8 plain tokens in 0.056 s
    assert run(fallback=False) == 8
    assert run(fallback=True) <= 4  # the same trees without the 0.032 s of drafting do better still
    failing_trie = LoadBudget(max_nodes=16, half_life=1e9)
    for _ in range(50):
        failing_trie.observe_tree(DraftTree.chain([1, 2, 3]), [])  # the trie's trees are never accepted
    assert run(fallback=True, trie=failing_trie) == 8  # so retrieval alone is no better than no drafting


def test_plain_requests_count_as_requests_without_nodes():
    """A probe drafts for a few requests; the step's other decoding requests
    (one row, one token each) must weigh in the rate as empty trees would."""
    rng = np.random.default_rng(5)
    for _ in range(100):
        p_hat = [np.sort(rng.random(int(rng.integers(0, 6))))[::-1] for _ in range(int(rng.integers(1, 4)))]
        fixed, per_row, plain = float(rng.random() * 0.1), float(rng.random() * 0.01), int(rng.integers(0, 60))
        with_empty = allocate(p_hat + [np.zeros(0)] * plain, fixed, per_row, 0)
        assert allocate(p_hat, fixed, per_row, 0, plain=plain) == with_empty[: len(p_hat)]


@pytest.mark.parametrize("fitted", [True, False], ids=["fitted", "cold"])
def test_nodes_below_the_floor_are_never_kept(fitted):
    """Trees cut at :meth:`LoadBudget.floor` before :meth:`LoadBudget.choose`
    (as the drafter cuts them) give the same choice as whole trees, and no
    kept node is below the floor, with this step's drafting time observed in
    between, as the engine does. Every other step drafts at the recent cost
    per request, and there the floor changes no choice (the same as a budget
    never asked for one); the others cost up to 20 ms per request, often many
    times the recent cost, a jump the floor's margin does not cover (step 30:
    14 times, after which whole trees would keep nodes at p 0.209 and 0.212
    under the floor 0.217)."""
    rng = np.random.default_rng(5)
    tree_rng = random.Random(5)
    cut = 0
    for step in range(60):
        budget = LoadBudget(max_nodes=16, half_life=1e9)
        budget.cold_trials = COLD_TRIALS  # past the cold start's trials (whose floor is 0)
        fixed, per_row = rng.uniform(0.02, 0.3), rng.uniform(0.0005, 0.005)
        per_tree, per_branching = rng.uniform(0, 0.01), rng.uniform(0, 0.01)
        for _ in range(40 if fitted else 0):
            verified = int(rng.integers(0, 5))
            branching = int(rng.integers(0, verified + 1))
            rows = int(rng.integers(4, 64)) + verified * int(rng.integers(1, 9))
            seconds = fixed + per_row * rows + per_tree * verified + per_branching * branching
            budget.fit.observe(rows, seconds, 0, verified, branching)
        budget.observe_drafting(4, float(rng.uniform(0.0, 0.01)))
        requests, plain = int(rng.integers(1, 40)), int(rng.integers(0, 40))
        ids = [f"r{r}" for r in range(requests)]
        record = DraftTree([1, 2], [-1, 0], [0.3, 0.3])  # accepted well above its p: factor up to MAX_FACTOR
        for request_id in ids[: requests // 2]:
            budget.observe_tree(record, [0, 1] if rng.random() < 0.7 else [], request_id)
        trees = [random_bfs_tree(tree_rng, int(rng.integers(0, 12))) for _ in ids]
        never_floored = copy.deepcopy(budget)
        floor = budget.floor(requests, plain)
        steady, drawn = step % 2 == 1, float(rng.uniform(0.0, 0.02))
        per_request = budget.draft_cost() if steady else drawn
        for b in (budget, never_floored):
            b.observe_drafting(requests, per_request * requests)
        floored = [t.subset([i for i, p in enumerate(t.path_probabilities()) if p >= floor]) for t in trees]
        cut += sum(len(t) - len(f) for t, f in zip(trees, floored))
        whole = copy.deepcopy(budget).choose(trees, ids, plain=plain, floor=floor).trees
        assert budget.choose(floored, ids, plain=plain, floor=floor).trees == whole
        assert all(p >= floor for tree in whole for p in tree.path_probabilities())
        if steady:
            assert never_floored.choose(trees, ids, plain=plain).trees == whole
    assert cut > 100, cut


def test_a_step_verifies_at_most_twice_the_rows_the_fit_has_measured():
    """The step-cost fit is linear in decode rows and only measured where
    steps were: fitted on batch-8 steps, it would let the first batch-64 step
    verify every node of 64 trees (2,112 rows for 33-node trees). That step
    keeps the best nodes over the batch up to twice the rows measured so far,
    and the limit grows with each step measured at it."""
    budget = LoadBudget(max_nodes=32, half_life=1e9)
    rng = np.random.default_rng(0)
    for _ in range(40):  # batch 8, up to 32 nodes kept a step, rows nearly free
        rows = 8 + int(rng.integers(0, 33))
        budget.fit.observe(rows, 0.05 + 1e-5 * rows, 0, 8, 0)
    assert budget.fit.max_rows <= 40
    trees = []
    for r in range(64):
        tree = DraftTree.chain(list(range(32)))
        tree.q = [0.999 - 0.0002 * r] * 32
        trees.append(tree)
    budget.observe_drafting(64, 0.001)
    choice = budget.choose(trees)
    kept = [len(t) for t in choice.trees]
    room = 2 * budget.fit.max_rows - 64
    assert sum(kept) == max(room, 32) and choice.trust_cut
    p = [t.path_probabilities() for t in trees]
    worst_kept = min(q for ps, k in zip(p, kept) for q in ps[:k])
    best_left = max(q for ps, k in zip(p, kept) for q in ps[k:])
    assert worst_kept >= best_left, "the best nodes over the batch"
    limits = []
    for _ in range(6):  # each step measured at the limit doubles it
        rows = 64 + sum(kept)
        budget.fit.observe(rows, 0.05 + 1e-5 * rows, 0, 64, 0)
        choice = budget.choose(trees)
        kept = [len(t) for t in choice.trees]
        limits.append(64 + sum(kept))
    assert limits[:2] == [2 * (64 + max(room, 32)), 4 * (64 + max(room, 32))]
    assert limits[-1] == 64 * 33, "every node, once the fit has seen steps that large"
    assert not choice.trust_cut


def test_a_cold_start_verifies_each_tree_s_best_node_on_its_first_trials():
    """A head whose draft probabilities are all below ``cold_min_p``: its
    first ``COLD_TRIALS`` drafting steps still verify each tree's best node
    (else no tree is ever verified, and neither its calibration nor a batch-1
    fit can be learnt); after them only likely nodes are kept."""

    budget = LoadBudget(max_nodes=8, cold_min_p=0.3, half_life=1e9)
    assert budget.floor(2) == 0.0  # the trials keep the best node however unlikely
    tree = DraftTree([5, 6, 7], [-1, 0, -1], [0.15, 0.5, 0.1])  # p: .15 .075 .1
    kept = [budget.choose([tree, DraftTree()]).trees for _ in range(COLD_TRIALS + 2)]
    assert kept[:COLD_TRIALS] == [[DraftTree([5], [-1], [0.15]), DraftTree()]] * COLD_TRIALS
    assert kept[COLD_TRIALS:] == [[DraftTree(), DraftTree()]] * 2
    assert budget.floor(2) > 0.0


def test_a_retrieval_budget_makes_no_cold_trials():
    """A retrieval trie's ``q`` are fitted acceptance chances: its cold start
    keeps only likely nodes from the first step (and its floor is the cold one)."""
    budget = LoadBudget(max_nodes=8, cold_min_p=0.3, realized=False)
    assert budget.floor(1) > 0.0
    assert budget.choose([DraftTree([5], [-1], [0.15])]).trees == [DraftTree()]
