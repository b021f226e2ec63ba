"""Which drafted nodes a step verifies: the load budget's math as pure
functions (docs/algorithms.md section 8).

A step keeps, over the whole batch, the nodes that maximise its expected
committed tokens per second ``G / C`` with ``G = B + sum of kept p_hat`` and
``C = fixed + per_row * (B + n_kept) + per_tree * trees + per_draft * B_drafting``
(``cost_fit.Fit``; ``per_draft`` the drafter's time per drafting request). A
ratio of sums over nodes that each add ``p_hat`` to ``G`` and ``per_row`` to
``C`` is maximised by keeping exactly the nodes with ``p_hat > per_row * G / C``
at the optimum, found greedily by descending ``p_hat``; as ``p`` never rises
along a path, each tree's kept set is closed under ancestors.

Decision (plain Python lists, no numpy): a step's values are a few dozen to
a few hundred floats, handled on the host right after the forward, where a
numpy call costs tens of microseconds (``cost_fit``'s "Decision (plain
Python, no numpy)"); sorting and summing lists of floats costs less.
"""

from __future__ import annotations

from typing import NamedTuple

from vllm_adaptive_spec.budget.cost_fit import Fit
from vllm_adaptive_spec.trees.tree import DraftTree

MAX_FACTOR = 2.0  # the calibration's largest value (``calibration.Calibration``)
FLOOR_MARGIN = 0.8  # see :func:`floor`


def expected(trees: list[DraftTree], factors: list[float], max_nodes: int) -> list[list[float]]:
    """Each tree's ``p_hat`` (path probability times its ``factor``) in keep
    order, descending, at most ``max_nodes`` of them."""
    return [[float(p) * factor for p in sorted(t.path_probabilities(), reverse=True)[:max_nodes]]
            for t, factor in zip(trees, factors)]


def allocate(
    p_hat: list[list[float]], fixed: float, per_row: float, draft_seconds: float = 0.0, plain: int = 0
) -> list[int]:
    """Nodes to keep per request: ``p_hat[r]`` holds request ``r``'s expected
    acceptances in its keep order (descending); returns how many of each
    maximise ``(B + plain + kept p_hat) / (fixed + draft_seconds + per_row * (B + plain + kept))``
    (``plain``: requests of the step that decode one row without a tree)."""
    batch = len(p_hat)
    gain = float(batch + plain)
    cost = fixed + draft_seconds + per_row * (batch + plain)
    if batch == 0:
        return []
    kept = [0] * batch
    for value, owner in _pooled(p_hat):
        if value <= 0 or value * cost <= per_row * gain:
            break
        gain += value
        cost += per_row
        kept[owner] += 1
    return kept


def _pooled(p_hat: list[list[float]]) -> list[tuple[float, int]]:
    """Every request's values with their request, from the largest (in
    request order among equals)."""
    pooled = [(float(value), r) for r, values in enumerate(p_hat) for value in values]
    pooled.sort(key=lambda pair: pair[0], reverse=True)  # stable: equals keep their order
    return pooled


def within(p_hat: list[list[float]], kept: list[int], room: int) -> list[int]:
    """``kept`` cut to the ``room`` best nodes over all requests (each
    request's first ``kept[r]`` of ``p_hat[r]``, which are in descending
    order, so every request keeps a prefix of its own)."""
    if sum(kept) <= room:
        return list(kept)
    counts = [0] * len(kept)
    for _, owner in _pooled([v[:k] for v, k in zip(p_hat, kept)])[: max(room, 0)]:
        counts[owner] += 1
    return counts


def floor(fit: Fit | None, cold_min_p: float, per_draft: float, requests: int, plain: int) -> float:
    """A path probability below which no node of a step with ``requests``
    drafting and ``plain`` other decoding requests is kept, whatever the
    requests' records: a node is kept only if its ``p_hat`` exceeds ``per_row``
    times the expected rate, which adding nodes only raises above the rate
    with none, and ``p_hat <= MAX_FACTOR * p``. ``FLOOR_MARGIN`` covers a rise
    of up to 25% in the step time that rate is computed from (the step's own
    drafting time is not known yet). Before the fit: ``cold_min_p``'s bound."""
    if fit is None:
        return FLOOR_MARGIN * cold_min_p / MAX_FACTOR
    rows = requests + plain
    rate = rows / (fit.fixed + per_draft * requests + fit.per_row * rows)
    return FLOOR_MARGIN * fit.per_row * rate / MAX_FACTOR


class NodePlan(NamedTuple):
    """Nodes kept per tree, the rate the trees were cut at, the expected
    committed tokens per second with the kept nodes, and whether the trust
    region (``room``) cut them."""

    kept: list[int]
    rate: float
    expected_rate: float
    trust_cut: bool


def plan_nodes(p_hat: list[list[float]], fit: Fit, per_draft: float, plain: int, room: int) -> NodePlan:
    """The nodes to keep (:func:`allocate` within ``room``), then the trees
    whose nodes do not pay their tree's own cost ``per_tree`` dropped, twice, at
    the resulting rate."""
    n = len(p_hat)

    def expected_rate(kept: list[int]) -> float:
        gain = n + plain + sum(sum(v[:k]) for v, k in zip(p_hat, kept))
        seconds = (fit.fixed + per_draft * n + fit.per_row * (n + plain + sum(kept))
                   + fit.per_tree * sum(k > 0 for k in kept))
        return gain / seconds

    wanted = allocate(p_hat, fit.fixed, fit.per_row, per_draft * n, plain)
    kept = within(p_hat, wanted, room)
    cut = sum(kept) < sum(wanted)
    for _ in range(2):
        rate = expected_rate(kept)
        kept = [k if sum(v[:k]) - fit.per_row * k * rate >= fit.per_tree * rate else 0
                for v, k in zip(p_hat, kept)]
    return NodePlan(kept, rate, expected_rate(kept), cut)


def shaped(tree: DraftTree, factor: float, fit: Fit, rate: float) -> DraftTree:
    """``tree`` cut to its main path when its nodes off that path do not pay
    ``per_branching``, what a branching tree costs beyond a chain of its rows, net of
    their rows' cost at the step's ``rate``."""
    if not tree.branches():
        return tree
    path = tree.main_path()
    off_path = sorted(tree.path_probabilities(), reverse=True)[len(path):]
    net = sum(factor * p - fit.per_row * rate for p in off_path)
    return path if net < fit.per_branching * rate else tree


def modelled_seconds(fit: Fit, plain_seconds: float, per_draft: float, trees: list[DraftTree]) -> float:
    """What a step with the chosen ``trees`` costs by the fit: a plain
    step's ``plain_seconds``, the drafting, the rows, and the trees' own
    and branching costs."""
    verified = sum(1 for t in trees if len(t))
    branching = sum(1 for t in trees if t.branches())
    return (plain_seconds + per_draft * len(trees) + fit.per_row * sum(len(t) for t in trees)
            + fit.per_tree * verified + fit.per_branching * branching)
