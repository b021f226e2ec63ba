"""What the load budget plans a step against: one of two cost models, chosen
with the step mode (``adapter/ragged_or_uniform``), under one
:class:`~vllm_adaptive_spec.budget.load_budget.LoadBudget`.

* :class:`LinearCost` (ragged steps): the fitted line of ``cost_fit``, a
  tree's row costing its share of the step (``per_row``), a tree and a
  branching tree their own (``per_tree``, ``per_branching``); the budget keeps the nodes
  worth their row (``node_allocation.plan_nodes``), a tree's nodes off its
  main path only where branching pays (``node_allocation.shaped``).
* :class:`ShapeCost` (uniform steps, ``trees.uniform_widths``): every decoding
  request of a drafting step has ``1 + W`` rows whatever its tree fills, so
  a step costs the measured time of its shape (``cost_table``), not a
  price per row; within the width a node costs nothing more and the choice
  is the width: each tree's best ``W`` nodes, ``W`` maximising the step's
  expected committed tokens per second (:func:`best_width`). Until the
  draft-free step of the batch at hand is measured it plans as the line
  does (whose steps then fill the table).

The calibration, the floor, pauses, probes and the trust region are the
budget's, the same code whichever model it plans against. Decision: the
drafting time of a step is left out of the choice of ``W`` (it is spent
whatever is verified) and counted in the step's judgement.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from vllm_adaptive_spec.budget.cost_fit import StepCostFit
from vllm_adaptive_spec.budget.cost_table import StepCostTable
from vllm_adaptive_spec.budget.node_allocation import modelled_seconds, plan_nodes, shaped
from vllm_adaptive_spec.trees.tree import DraftTree


class Planned(NamedTuple):
    """A step's plan: the ``trees`` kept, their expected committed tokens
    per second (``rate``, drafting included), the modelled step's
    ``seconds``, a draft-free step's ``plain_seconds``, and whether the
    trust region cut the nodes (``trust_cut``)."""

    trees: list[DraftTree]
    rate: float
    seconds: float
    plain_seconds: float
    trust_cut: bool


class LinearCost:
    """The line through the measured steps (``cost_fit.StepCostFit``)."""

    width_choices = 0  # steps whose width measured shapes chose (none here)

    def __init__(self, fit: StepCostFit) -> None:
        self.fit = fit

    def observe(self, tokens: int, seconds: float, prefill_tokens: int = 0, trees: int = 0, branching: int = 0,
                uniform_rows: int | None = None) -> None:
        """One engine step (``StepCostFit.observe``; ``uniform_rows``: the
        rows every request of a decode-only step had, None otherwise)."""
        self.fit.observe(tokens, seconds, prefill_tokens, trees, branching)

    def known(self, batch: int) -> bool:
        """Whether a step of ``batch`` decoding requests can be planned."""
        return self.fit.solve() is not None

    def plain_seconds(self, batch: int) -> float:
        fit = self.fit.solve()
        return fit.fixed + fit.per_row * batch

    def plan(self, trees: list[DraftTree], p_hat, factors: list[float], plain: int, per_draft: float, room: int,
             at_least: int = 0) -> Planned:
        """Each tree's planned nodes (at least ``at_least``, a probe's)
        within ``room``, cut to its main path where branching does not pay;
        ``per_draft``: drafting seconds per drafting request."""
        fit = self.fit.solve()
        plan = plan_nodes(p_hat, fit, per_draft, plain, room)
        kept = [shaped(tree.keep_best(max(count, at_least)), factor, fit, plan.rate)
                for tree, count, factor in zip(trees, plan.kept, factors)]
        plain_seconds = self.plain_seconds(len(trees) + plain)
        seconds = modelled_seconds(fit, plain_seconds, per_draft, kept)
        return Planned(kept, plan.expected_rate, seconds, plain_seconds, plan.trust_cut)

    def tree_seconds(self, batch: int, trees: int, nodes: float, depth: int) -> float:
        """A modelled step of ``batch`` decoding requests, ``trees`` of them
        verifying ``nodes`` nodes (a mean) at most ``depth`` deep: a tree of
        more nodes than its depth branches."""
        if nodes <= 0.0:
            return self.plain_seconds(batch)
        fit = self.fit.solve()
        branching = fit.per_branching if nodes > depth + 1e-9 else 0.0
        return self.plain_seconds(batch) + fit.per_row * trees * nodes + (fit.per_tree + branching) * trees

    def best_rate(self, p_hat, plain: int, room: int) -> float:
        """The best expected rate of trees drafted for free (``p_hat``: the
        hybrid's trie, which its model's drafting is judged against)."""
        return plan_nodes(p_hat, self.fit.solve(), 0.0, plain, room).expected_rate


def best_width(
    p_hat: list[list[float]], plain: int, widths: tuple[int, ...], cost: Callable[[int], float | None]
) -> tuple[int, float]:
    """The width ``W`` (0: no node) of the highest expected rate, and that
    rate: ``(B + sum_r sum(p_hat[r][:W])) / cost(1 + W)``, ``B`` the
    drafting requests and the ``plain`` others; widths of unknown cost are
    skipped. ``p_hat[r]`` is in keep order (descending); ``cost(1)`` must be known."""
    batch = len(p_hat) + plain
    best, best_rate = 0, batch / cost(1)
    for width in widths:
        seconds = cost(1 + width)
        if seconds is None or seconds <= 0.0:
            continue
        rate = (batch + sum(sum(v[:width]) for v in p_hat)) / seconds
        if rate > best_rate:
            best, best_rate = width, rate
    return best, best_rate


class ShapeCost:
    """The measured time of each uniform step shape (``cost_table``),
    over the step widths ``widths``; the line (``linear``) until the batch's
    draft-free step is measured."""

    def __init__(self, widths: tuple[int, ...], table: StepCostTable, linear: LinearCost) -> None:
        self.widths, self.table, self.linear = widths, table, linear
        self.fit = linear.fit
        self.width_choices = 0  # steps whose width the measured shapes chose

    def observe(self, tokens: int, seconds: float, prefill_tokens: int = 0, trees: int = 0, branching: int = 0,
                uniform_rows: int | None = None) -> None:
        self.linear.observe(tokens, seconds, prefill_tokens, trees, branching)
        if uniform_rows:
            self.table.observe(tokens // uniform_rows, uniform_rows, seconds)

    def _measured(self, batch: int) -> bool:
        return self.table.cost(batch, 1) is not None

    def known(self, batch: int) -> bool:
        return self._measured(batch) or self.linear.known(batch)

    def plain_seconds(self, batch: int) -> float:
        return self.table.cost(batch, 1) if self._measured(batch) else self.linear.plain_seconds(batch)

    def plan(self, trees: list[DraftTree], p_hat, factors: list[float], plain: int, per_draft: float, room: int,
             at_least: int = 0) -> Planned:
        """Each tree's best :func:`best_width` nodes. ``at_least`` does not
        apply: a uniform step's width is every decoding request's, so one
        newcomer's probe would widen the whole batch; a probe keeps nodes
        only where a width pays."""
        batch = len(trees) + plain
        if not self._measured(batch):
            return self.linear.plan(trees, p_hat, factors, plain, per_draft, room, at_least)
        self.width_choices += 1
        width, _ = best_width(p_hat, plain, self.widths, lambda rows: self.table.cost(batch, rows))
        plain_seconds = self.table.cost(batch, 1)
        seconds = (self.table.cost(batch, 1 + width) if width else plain_seconds) + per_draft * len(trees)
        gain = batch + sum(sum(v[:width]) for v in p_hat)
        return Planned([tree.keep_best(width) for tree in trees], gain / seconds, seconds, plain_seconds, False)

    def tree_seconds(self, batch: int, trees: int, nodes: float, depth: int) -> float:
        """The measured step of the narrowest width that holds ``nodes``
        (rounded up; the widest where none does), as the line models it
        until the batch's draft-free step is measured."""
        if not self._measured(batch):
            return self.linear.tree_seconds(batch, trees, nodes, depth)
        if nodes <= 0.0:
            return self.plain_seconds(batch)
        width = next((w for w in sorted(self.widths) if w >= nodes - 1e-9), max(self.widths))
        return self.table.cost(batch, 1 + width)

    def best_rate(self, p_hat, plain: int, room: int) -> float:
        batch = len(p_hat) + plain
        if not self._measured(batch):
            return self.linear.best_rate(p_hat, plain, room)
        return best_width(p_hat, plain, self.widths, lambda rows: self.table.cost(batch, rows))[1]
