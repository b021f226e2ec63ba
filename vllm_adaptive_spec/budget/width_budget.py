"""The load budget of uniform steps (issue 52, item 5).

With uniform steps (``step_widths``) every decoding request of a drafting
step has ``1 + W`` rows whatever its tree fills, so what a step costs is the
measured time of its shape (``step_cost_table.StepCostTable``), not a price
per row: within the width a node costs nothing more, and the choice is the
width. :class:`WidthBudget` keeps each tree's best ``W`` nodes (by path
probability, as ``DraftTree.keep_best``; on the device
``tree_tensors.select_within_width``), ``W`` the width that maximises the
step's expected committed tokens per second::

    (B + sum over requests of their W best p_hat) / cost(B, 1 + W)

``W = 0`` (no node) included, ``B`` the step's decoding requests, ``p_hat``
the calibrated acceptance of :class:`~vllm_adaptive_spec.budget.load_budget.LoadBudget`.
Everything else is the load budget's: the calibration, the floor (its nodes
are dropped first, so the floor guarantee holds as on the CPU), pauses,
probes, windows and control steps, judged against the measured draft-free
step of the same batch. Until that step is measured for the batch at hand,
the budget chooses as :class:`LoadBudget` does (its steps then fill the
table). Decision: the drafting time of the step is left out of the choice
of ``W`` (it is spent whatever is verified) and counted in its judgement.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from vllm_adaptive_spec.budget.load_budget import Choice, LoadBudget
from vllm_adaptive_spec.budget.step_cost import StepCostFit
from vllm_adaptive_spec.budget.step_cost_table import StepCostTable
from vllm_adaptive_spec.trees.tree import DraftTree


def best_width(
    p_hat: list[np.ndarray], plain: int, widths: tuple[int, ...], cost: Callable[[int], float | None]
) -> tuple[int, float]:
    """The width ``W`` (0: no node) of the highest expected rate, and that
    rate: ``(B + sum_r p_hat[r][:W].sum()) / cost(1 + W)``, ``B`` the
    drafting requests and the ``plain`` others; widths of unknown cost are
    skipped. ``p_hat[r]`` is in keep order (descending); ``cost(1)`` must be known."""
    batch = len(p_hat) + plain
    best, best_rate = 0, batch / cost(1)
    for width in widths:
        seconds = cost(1 + width)
        if seconds is None or seconds <= 0.0:
            continue
        rate = (batch + sum(float(v[:width].sum()) for v in p_hat)) / seconds
        if rate > best_rate:
            best, best_rate = width, rate
    return best, best_rate


class WidthBudget(LoadBudget):
    def __init__(self, max_budget: int, widths: tuple[int, ...], table: StepCostTable,
                 fit: StepCostFit | None = None, **kwargs) -> None:
        super().__init__(max_budget, fit, **kwargs)
        self.widths, self.table = widths, table

    def choose(
        self, trees: list[DraftTree], request_ids: list[str] | None = None,
        fallback: list[DraftTree] | None = None, plain: int = 0, fallback_budget: LoadBudget | None = None,
        floor: float = 0.0,
    ) -> Choice:
        """Each tree's best :func:`best_width` nodes (arguments as
        :meth:`LoadBudget.choose`; ``fallback`` is judged at its own best width)."""
        batch = len(trees) + plain
        if self.table.cost(batch, 1) is None:
            return super().choose(trees, request_ids, fallback, plain, fallback_budget, floor)
        trees, ids, rhos = self._calibrated(trees, request_ids, floor)
        p_hat = self.expected(trees, rhos)

        def cost(rows: int) -> float | None:
            return self.table.cost(batch, rows)

        width, _ = best_width(p_hat, plain, self.widths, cost)
        plain_seconds = cost(1)
        without = batch / plain_seconds
        if fallback is not None:
            scorer = fallback_budget or self
            without = max(without, best_width(self.expected(fallback, [scorer.calibration(r) for r in ids]),
                                              plain, self.widths, cost)[1])
        delta = self.draft_cost()
        seconds = (cost(1 + width) if width else plain_seconds) + delta * len(trees)
        gain = batch + sum(float(v[:width].sum()) for v in p_hat)
        self.pauses.judge(gain / seconds if trees and delta > 0.0 else None, without, batch, seconds, plain_seconds)
        return Choice([tree.keep_best(width) for tree in trees], trust_cut=False)

    def probe(self, trees: list[DraftTree], request_ids: list[str], plain: int = 0) -> list[DraftTree]:
        """Newcomers' trees while paused (:meth:`LoadBudget.probe`). A
        uniform step's width is every decoding request's, so one newcomer's
        probe would widen the whole batch: once the batch's draft-free step
        is measured, the probes keep the :func:`best_width` nodes, none where
        no width pays; before that, as :meth:`LoadBudget.probe`."""
        batch = len(trees) + plain
        if self.table.cost(batch, 1) is None:
            return super().probe(trees, request_ids, plain)
        trees, _, rhos = self._calibrated(trees, request_ids, 0.0)
        width, _ = best_width(self.expected(trees, rhos), plain, self.widths, lambda rows: self.table.cost(batch, rows))
        return [tree.keep_best(width) for tree in trees]
