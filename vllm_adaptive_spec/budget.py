"""A node budget that follows the load (ALGORITHMS.md section 8).

Verifying a tree is nearly free at batch size 1 and costs real compute once
the batch is large; the best per-request budget ``n <= N`` shrinks with load,
down to no speculation. :class:`LoadBudget` picks, each step, the ``n`` that
maximises the expected committed tokens per second of the whole step::

    B * (1 + A(n)) / (alpha + beta * (T_other + B * (1 + n)))

* ``A(n)``, accepted tokens per tree with budget ``n``, is measured for every
  ``n`` at once: a tree's nodes are ranked in the order a smaller budget would
  keep them (path probability, the order of every policy's trim), so a tree
  verified with budget ``N`` tells what budget ``m < N`` would have accepted:
  its accepted nodes of rank below ``m``.
* ``alpha + beta * T`` is the step time for ``T`` scheduled tokens, fitted by
  exponentially weighted least squares on measured steps.

Decision: one budget for every request of a step (the cost is per step); in
one step of ``explore_every`` one request drafts at the full ``N``, so that
``A`` stays known for every ``n`` at a bounded cost; estimates decay with
``half_life`` steps so they follow the workload.
"""

from __future__ import annotations

import math

import numpy as np

from vllm_adaptive_spec.tree import ROOT, DraftTree


def budget_ranks(tree: DraftTree) -> list[int]:
    """Rank of every node in the order a smaller budget keeps them: by path
    probability, earlier node first on ties (ancestors always rank first)."""
    p: list[float] = []
    for parent, q in zip(tree.parents, tree.q):
        p.append(q if parent == ROOT else p[parent] * q)
    order = sorted(range(len(p)), key=lambda i: (-p[i], i))
    ranks = [0] * len(p)
    for rank, node in enumerate(order):
        ranks[node] = rank
    return ranks


class LoadBudget:
    MIN_STEPS = 8  # measured steps before the cost fit is trusted

    def __init__(self, max_budget: int, explore_every: int = 8, half_life: float = 200.0) -> None:
        self.max_budget = max_budget
        self.explore_every = explore_every
        self.decay = 0.5 ** (1.0 / half_life)
        self.gain = np.zeros(max_budget + 1)  # decayed sum of accepted tokens with budget m
        self.trees = np.zeros(max_budget + 1)  # decayed number of trees informing budget m
        self.moments = np.zeros(5)  # decayed sums: w, T, t, T*T, T*t
        self.steps_seen = 0
        self.choices = 0

    def observe_tree(self, tree: DraftTree, accepted_nodes: list[int], informs: int) -> None:
        """A verified tree, the indices of its accepted nodes, and the largest
        budget it speaks for: the budget it was drafted with when the drafter
        found fewer nodes (a larger budget drafts the same tree), else its size."""
        ranks = budget_ranks(tree)
        accepted_ranks = np.array(sorted(ranks[i] for i in accepted_nodes), dtype=np.int64)
        budgets = np.arange(min(informs, self.max_budget) + 1)
        self.gain[: budgets.size] += np.searchsorted(accepted_ranks, budgets, side="left")
        self.trees[: budgets.size] += 1

    def observe_step(self, tokens: int, seconds: float) -> None:
        """One engine step: ``tokens`` scheduled, ``seconds`` of wall time."""
        self.gain *= self.decay
        self.trees *= self.decay
        self.moments *= self.decay
        self.moments += (1.0, tokens, seconds, tokens * tokens, tokens * seconds)
        self.steps_seen += 1

    def cost(self) -> tuple[float, float] | None:
        """``(alpha, beta)`` of the step-time fit, or None while unknown."""
        w, s_t, s_y, s_tt, s_ty = self.moments
        if self.steps_seen < self.MIN_STEPS:
            return None
        variance = w * s_tt - s_t * s_t
        if variance <= 1e-9 * max(w * s_tt, 1.0):
            return None
        beta = (w * s_ty - s_t * s_y) / variance
        alpha = (s_y - beta * s_t) / w
        return max(alpha, 0.0), max(beta, 0.0)

    def accepted(self) -> np.ndarray:
        """Estimated accepted tokens per tree for budgets 0..N (NaN: unknown)."""
        with np.errstate(invalid="ignore", divide="ignore"):
            return np.where(self.trees > 1e-6, self.gain / self.trees, np.nan)

    def explores(self) -> bool:
        """Whether this step lets one request draft at the full budget."""
        self.choices += 1
        return self.choices % self.explore_every == 0

    def choose(self, requests: int, other_tokens: int) -> int:
        """The per-request budget for a step with ``requests`` drafting requests
        and ``other_tokens`` scheduled tokens besides theirs."""
        fit = self.cost()
        gains = self.accepted()
        if requests == 0 or fit is None or math.isnan(gains[self.max_budget]):
            return self.max_budget
        alpha, beta = fit
        n = np.arange(self.max_budget + 1)
        known = ~np.isnan(gains)
        rate = requests * (1 + np.where(known, gains, 0.0)) / (
            alpha + beta * (other_tokens + requests * (1 + n)) + 1e-12
        )
        rate[~known] = -1.0
        return int(np.argmax(rate))
