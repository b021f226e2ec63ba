"""What an engine step costs, fitted online (docs/algorithms.md section 8).

Step time = ``fixed + per_row * decode rows + per_prompt_token * prompt
tokens + per_tree * trees + per_branching * branching trees`` (seconds):
exponentially weighted least squares over measured steps. ``fixed`` is the
step's fixed cost, ``per_row`` a decode row's (a request's row or a tree
node's), ``per_prompt_token`` a prompt-chunk token's (cheaper than a decode
row, so one slope for both would understate a node's cost), ``per_tree`` what
verifying a tree costs beyond its rows (layout, verification, KV compaction),
``per_branching`` what a branching tree costs beyond a chain of its rows (on
vLLM's CPU platform a chain runs in vLLM's own attention kernel, a branching
tree in the plugin's tree path).

Decision: one fit per engine, shared by every load budget of it (the hybrid
drafter's model and its retrieval trie each have one): they see the same
steps, so one regression, solved once per step, serves them all.

The trees column is told from the fixed cost only by decode steps with a
different number of trees; when every recent step verified a tree for every
request (a model drafter at batch 1), a tree's own cost would be read as
part of ``fixed``, so a step without drafting would look that much dearer
and drafting that much better than it is (at batch 1 on the CPU, 20%).
:meth:`tree_spread` tells the load budget when it must run a control step
without trees.

Decision (a prior on the branching column): ``per_branching`` starts at 0
with the weight of ``PRIOR_STEPS`` steps of one branching tree each (a ridge
term on its column), so it is read from many steps, not the first few. One
engine's fit read it as 8 ms after its first branching tree and 12-33 ms
through batch 1 and 8, while another engine of the same settings measured
under 1 ms between its steps with and without a branching tree at equal
rows (3 rows: 40.2 against 39.6 ms; 17 rows: 51.2 against 52.0 ms), and its
steps, replayed into a fresh fit, gave 0. At batch 1 a branching tree is
also a large tree, where rows cost least, so a few such steps can set the
column; and a column priced that high keeps branching trees out, so no later
step corrects it. The prior weighs little beside a column the steps vary (a
retrieval tree branches on some steps, not others), so a cost that is there
is still found. ``per_tree`` has no prior: where every step verifies trees,
the budget's rare control steps are what tells it from ``fixed``, and a
prior would outweigh them.

Decision (plain Python, no numpy): the regression is a 5 x 5 system, solved
once per engine step on the host right after the forward. There each numpy
call costs tens of microseconds (the forward has left the host's caches
cold), far more than its arithmetic: the numpy solve (a condition number by
SVD, then the solve, up to four column subsets) took about 0.2 ms a step on
a 2-core AMD EPYC, a quarter of the retrieval drafter's whole drafting
phase at batch 1. A Cholesky factorisation in floats does the same work in
a few dozen microseconds. A column subset is degenerate where a column is
(almost) a combination of the others: its Cholesky pivot, with the columns
scaled to unit diagonal, below ``COLLINEAR`` (a correlation above
1 - 1e-10 with the others), independent of the columns' units.
"""

from __future__ import annotations

import math
from typing import NamedTuple

COLUMNS = 5  # 1, decode rows, prompt tokens, trees, branching trees
BRANCHING = 4  # the branching trees column
PRIOR_STEPS = 8.0  # see "Decision (a prior on the branching column)"
COLLINEAR = 1e-10  # a scaled Cholesky pivot below this: the column adds nothing the others lack


def solve_spd(matrix: list[list[float]], rhs: list[float]) -> list[float] | None:
    """``x`` with ``matrix x = rhs`` for a symmetric positive semi-definite
    ``matrix`` (lists of floats), or None where a column is (almost) a
    combination of the others (see "Decision (plain Python, no numpy)").
    The loops are written out over local rows: generator sums cost twice as
    much here."""
    n = len(rhs)
    diagonal = [matrix[i][i] for i in range(n)]
    if min(diagonal) <= 0.0:
        return None
    scale = [1.0 / math.sqrt(value) for value in diagonal]
    lower: list[list[float]] = []  # of the matrix scaled to unit diagonal
    for i in range(n):
        row, row_scale, given = [], scale[i], matrix[i]
        for j in range(i):
            above = lower[j]
            total = given[j] * row_scale * scale[j]
            for k in range(j):
                total -= row[k] * above[k]
            row.append(total / above[j])
        pivot = 1.0 - sum(value * value for value in row)
        if pivot < COLLINEAR:
            return None
        row.append(math.sqrt(pivot))
        lower.append(row)
    y: list[float] = []
    for i in range(n):
        row, total = lower[i], rhs[i] * scale[i]
        for k in range(i):
            total -= row[k] * y[k]
        y.append(total / row[i])
    x = [0.0] * n
    for i in reversed(range(n)):
        total = y[i]
        for k in range(i + 1, n):
            total -= lower[k][i] * x[k]
        x[i] = total / lower[i][i]
    return [x[i] * scale[i] for i in range(n)]


class Fit(NamedTuple):
    """The fitted step cost, seconds: fixed, per decode row, per prompt-chunk
    token, per verified tree beyond its rows, per branching tree beyond a chain."""

    fixed: float
    per_row: float
    per_prompt_token: float
    per_tree: float
    per_branching: float


class StepCostFit:
    MIN_STEPS = 8  # measured steps before the fit is trusted

    def __init__(self, half_life: float = 200.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.gram = [[0.0] * COLUMNS for _ in range(COLUMNS)]  # decayed X^T X and X^T t
        self.moment = [0.0] * COLUMNS
        self.steps_seen = 0
        self.max_rows = 0  # the most decode rows of any measured step
        self._solution: Fit | None = None
        self._solved_at = -1

    def observe(
        self, tokens: int, seconds: float, prefill_tokens: int = 0, trees: int = 0, branching: int = 0
    ) -> None:
        """One engine step: ``tokens`` scheduled (``prefill_tokens`` of them
        prompt chunks, the rest one row per decoding request and its tree
        nodes; ``trees`` requests verified a tree, ``branching`` of them a
        branching one), ``seconds`` of wall time."""
        x = (1.0, float(tokens - prefill_tokens), float(prefill_tokens), float(trees), float(branching))
        self.max_rows = max(self.max_rows, tokens - prefill_tokens)
        decay = self.decay
        for row, xi in zip(self.gram, x):
            for j, xj in enumerate(x):
                row[j] = row[j] * decay + xi * xj
        self.moment = [m * decay + xi * seconds for m, xi in zip(self.moment, x)]
        self.steps_seen += 1

    def tree_spread(self) -> float:
        """How much the steps' numbers of trees vary: their (decayed)
        variance over their squared mean; infinite while no tree was seen.
        Near 0 the trees column cannot be told from the fixed cost."""
        weight = self.gram[0][0]
        mean = self.gram[0][3] / weight if weight > 0 else 0.0
        if mean <= 0:
            return float("inf")
        return max(self.gram[3][3] / weight - mean * mean, 0.0) / (mean * mean)

    def solve(self) -> Fit | None:
        """The :class:`Fit` (each term >= 0, ``fixed + per_row > 0``),
        or None before ``MIN_STEPS`` steps or when degenerate; a column never seen is left
        out (``per_prompt_token`` then equals ``per_row``, ``per_tree`` and
        ``per_branching`` are 0), as are the trees and branching columns when
        they cannot be told apart from the others."""
        if self._solved_at != self.steps_seen:
            self._solution = self._solve()
            self._solved_at = self.steps_seen
        return self._solution

    def _solve(self) -> Fit | None:
        if self.steps_seen < self.MIN_STEPS:
            return None
        gram = self.gram
        seen = [gram[c][c] > 1e-9 * max(gram[0][0], 1.0) for c in range(COLUMNS)]
        base = [0, 1] + ([2] if seen[2] else [])
        optional = [column for column in (3, 4) if seen[column]]
        subsets = [optional, *([c] for c in optional if len(optional) > 1), []]
        for used in [base + subset for subset in subsets]:
            matrix = [[gram[i][j] + PRIOR_STEPS * (i == j == BRANCHING) for j in used] for i in used]
            solution = solve_spd(matrix, [self.moment[c] for c in used])
            if solution is None:
                continue
            values = dict(zip(used, solution))
            fixed, per_row = max(values[0], 0.0), max(values[1], 0.0)
            if fixed + per_row > 0.0:  # else no step would cost anything: not a usable fit
                tree_terms = (max(values.get(c, 0.0), 0.0) for c in (3, 4))
                return Fit(fixed, per_row, max(values.get(2, per_row), 0.0), *tree_terms)
        return None

    def mean_step(self) -> float | None:
        """The (decayed) mean step time: known from the first step on, even
        while the fit cannot split it into its terms (every step the same
        shape); None before any step."""
        return self.moment[0] / self.gram[0][0] if self.steps_seen else None

    def cost(self) -> tuple[float, float, float] | None:
        """``(fixed, per_row, per_prompt_token)``, or None while unknown."""
        solution = self.solve()
        return None if solution is None else (solution.fixed, solution.per_row, solution.per_prompt_token)

    def tree_cost(self) -> float:
        """``per_tree``: seconds a verified tree costs beyond its rows (0 until known)."""
        solution = self.solve()
        return 0.0 if solution is None else solution.per_tree

    def branch_cost(self) -> float:
        """``per_branching``: seconds a branching tree costs beyond a chain of its rows (0 until known)."""
        solution = self.solve()
        return 0.0 if solution is None else solution.per_branching
