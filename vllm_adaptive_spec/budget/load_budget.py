"""The load budget: which drafted nodes are worth verifying this step, and
whether to draft at all (docs/algorithms.md section 8; the measurements
behind each decision: docs/load_budget.md).

A step goes through it in a fixed order: :meth:`LoadBudget.begin_step`
(does the step draft, for how many requests; ``pause_control``), then
:meth:`floor` (the path probability below which the step keeps nothing, so
the drafter leaves such nodes out), then :meth:`choose` with the grown trees
and that floor (which nodes to verify; ``node_allocation``), then
:meth:`observe_tree` per verified tree (``calibration``). The rules:

* Nodes: the ones that maximise the step's expected committed tokens per
  second, ``p_hat = rho_r * p`` each, against the step mode's cost model
  (``cost_models``: the step-cost fit of ragged steps, or the measured step
  shapes of uniform ones, where the choice is the width) and the drafter's
  measured time per request ``per_draft``. A step's prompt chunks are left out
  of the cost: they are paid whatever is drafted, so they make no node cheaper.
* Shape (ragged steps): a branching tree keeps its nodes off the main path
  only when they pay ``per_branching``, what a branching tree costs beyond a chain of its rows.
* Trust region: a step keeps at most as many nodes as bring its decode rows
  to ``ROW_GROWTH`` times the most any measured step had, and at least one
  whole tree (``max_nodes`` nodes), since the fit is linear and known only
  over the steps it measured; each step at the limit is measured, so the
  limit doubles per step while the nodes pay.
* Cold start: before the fit is known, nodes with ``p_hat >= cold_min_p``
  are kept (a trial that gives the fit the varied steps it needs), and, for
  a model drafter, on the first ``COLD_TRIALS`` steps that draft a node at
  least each tree's best one: a head whose draft probabilities are all low
  (an EAGLE-3 head's top token at 0.04-0.17 on held-out prompts, accepted far more
  often) would otherwise never have a tree verified, so neither its
  calibration nor, at batch 1 (every step one row), the fit could ever be
  learnt. A step that keeps no node is still judged, on the mean step time.
* Depth (model drafters): how many draft passes a step runs, the depth of
  the highest expected rate by the measured cost of a pass at this batch
  shape and what each depth's kept nodes brought (``draft_depth``).
* Down to no speculation: every measured step's rate with drafting is
  compared with the rate without (for the hybrid, the better of no drafting
  and its retrieval trie alone) and :mod:`~vllm_adaptive_spec.budget.pause_control`
  pauses a drafter that does not pay.
* Newcomers while paused: :meth:`probe` gives a request that has never had a
  tree verified its first one even while drafting is paused (the proposer
  asks, for drafters that draft without a model pass): the nodes
  :meth:`choose` would keep, and at least the best one. A pause judges the
  requests that were drafted for; a request that arrived during it has its
  own acceptance (structured output, a penalty, a prompt it repeats), which
  its probe measures for its own calibration.
"""

from __future__ import annotations

import sys
from typing import NamedTuple

from vllm_adaptive_spec.budget import node_allocation
from vllm_adaptive_spec.budget.calibration import Calibration
from vllm_adaptive_spec.budget.cost_fit import StepCostFit
from vllm_adaptive_spec.budget.cost_models import LinearCost, ShapeCost
from vllm_adaptive_spec.budget.draft_depth import DraftDepth, kept_by_depth
from vllm_adaptive_spec.budget.node_allocation import within
from vllm_adaptive_spec.budget.pause_control import PauseControl, PauseSettings, StepDecision
from vllm_adaptive_spec.trees.tree import DraftTree

ROW_GROWTH = 2  # see "Trust region"
COLD_TRIALS = 8  # see "Cold start"


class Choice(NamedTuple):
    """The trees a step verifies, and whether the trust region cut them."""

    trees: list[DraftTree]
    trust_cut: bool


class LoadBudget:
    """``max_nodes``: the drafter's ``N``; ``cost``: the engine's shared
    cost model (``cost_models``: the step mode's; a fresh
    :class:`~vllm_adaptive_spec.budget.cost_models.LinearCost` when None),
    whose step-cost fit ``fit`` the floor and the trust region read;
    ``half_life``: the decay, in steps, of a fresh fit and of the
    calibration; ``realized``: windows judged on committed tokens (model
    drafters); ``request_half_life`` and ``request_prior``: a request's own
    calibration (``Calibration``); ``settings``:
    :class:`~vllm_adaptive_spec.budget.pause_control.PauseSettings`."""

    def __init__(self, max_nodes: int, cost: LinearCost | ShapeCost | None = None, half_life: float = 200.0,
                 cold_min_p: float = 0.3, realized: bool = True, request_half_life: float = 32.0,
                 request_prior: float = 4.0, **settings) -> None:
        self.max_nodes = max_nodes
        self.cold_min_p = cold_min_p
        self.cost = cost if cost is not None else LinearCost(StepCostFit(half_life))
        self.fit = self.cost.fit
        self.calibrated = Calibration(half_life, request_half_life, request_prior)
        self.pauses = PauseControl(PauseSettings(**settings), realized)
        self.decay = 0.5 ** (1.0 / half_life)
        self.draft_seconds = 0.0  # decayed drafter time and drafting requests
        self.drafted_requests = 0.0
        self.depth = DraftDepth()
        # Cold steps that kept a tree's best node as a trial (see "Cold start"). A
        # retrieval trie starts with them spent: its ``q`` are fitted acceptance
        # chances already, and its paused part's steps must stay draft-free.
        self.cold_trials = 0 if realized else COLD_TRIALS

    # -- measurements -------------------------------------------------------

    def observe_tree(self, tree: DraftTree, accepted_nodes: list[int], request_id: str | None = None) -> None:
        """A verified tree (of ``request_id``) and the indices of its accepted nodes."""
        self.pauses.accepted(len(accepted_nodes))
        self.calibrated.observe(tree, len(accepted_nodes), request_id)

    def observe_drafting(self, requests: int, seconds: float, passes: int = 0) -> None:
        """The drafter grew ``requests`` trees in ``seconds``, ``passes``
        draft passes deep (a model drafter's, its first pass included)."""
        self.draft_seconds = self.draft_seconds * self.decay + seconds
        self.drafted_requests = self.drafted_requests * self.decay + requests
        self.depth.observe_drafting(requests, seconds, passes)
        self.pauses.drafted(seconds)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted."""
        self.calibrated.forget(request_id)

    def requests_held(self) -> int:
        return self.calibrated.requests_held()

    def calibration(self, request_id: str | None = None) -> float:
        """``factor``: the engine's, or request ``request_id``'s own shrunk toward it."""
        return self.calibrated.factor(request_id)

    def draft_cost(self, requests: int = 0, depth: int = 0) -> float:
        """Seconds of drafting per drafting request: for a step of
        ``requests`` drafting ``depth`` passes deep, what such a step
        measurably costs (``draft_depth``), else the mean over drafting
        steps. Decision: a step is judged at its own depth's cost, since a
        mean over deeper steps would judge a one-pass probe at the price of
        the policy's whole depth, and pause it."""
        modelled = self.depth.drafting_seconds(requests, depth) if requests and depth else 0.0
        if modelled > 0.0:
            return modelled / requests
        return self.draft_seconds / self.drafted_requests if self.drafted_requests > 1e-9 else 0.0

    # -- decisions ----------------------------------------------------------

    def begin_step(self) -> StepDecision:
        """What this step does (:class:`~vllm_adaptive_spec.budget.pause_control.StepDecision`)."""
        return self.pauses.begin_step(self.fit)

    def draft_depth(self, requests: int, plain: int, limit: int) -> int:
        """How many draft passes a model drafter's step with ``requests``
        drafting and ``plain`` other decoding requests runs, at most
        ``limit`` (``draft_depth``)."""
        batch = requests + plain
        known = self.cost.known(batch)
        return self.depth.choose(requests, plain, limit, (
            lambda nodes, depth: self.cost.tree_seconds(batch, requests, nodes, depth)) if known else None)

    def floor(self, requests: int, plain: int = 0, depth: int = 0) -> float:
        """The path probability below which :meth:`choose` keeps no node of a
        step with ``requests`` drafting ``depth`` passes deep (0: not a
        model drafter's) and ``plain`` other decoding requests
        (``node_allocation.floor``). The drafter leaves such nodes
        out (at batch 64 most of them); :meth:`choose`, given the same
        floor, drops them first, so the guarantee does not rest on the
        floor's margin."""
        fit = self.fit.solve()
        if fit is None and self.cold_trials < COLD_TRIALS:
            return 0.0  # a cold trial keeps each tree's best node, however unlikely
        return node_allocation.floor(fit, self.cold_min_p, self.draft_cost(requests, depth), requests, plain)

    def room(self, requests: int, plain: int = 0) -> int:
        """How many drafted nodes a step may verify (see "Trust region");
        unbounded before the first measured step."""
        if self.fit.max_rows <= 0:
            return sys.maxsize
        return max(ROW_GROWTH * self.fit.max_rows - requests - plain, self.max_nodes)

    def choose(
        self, trees: list[DraftTree], request_ids: list[str] | None = None,
        fallback: list[DraftTree] | None = None, plain: int = 0, fallback_budget: LoadBudget | None = None,
        floor: float = 0.0, grown_depth: int = 0, passes: int = 0,
    ) -> Choice:
        """The part of each grown tree worth verifying: what the cost
        model plans (``cost_models``: by path probability, cut to the main
        path where branching does not pay, or the best width of a uniform
        step). ``request_ids``: the trees' requests, whose own records
        calibrate them. ``fallback``: the same requests' trees from the
        drafter's paused part (the hybrid's retrieval trie), which drafting
        is judged against, calibrated by ``fallback_budget`` (default: this
        one). ``plain``: the step's other decoding requests. ``floor``: the
        step's :meth:`floor`; nodes below it are dropped first.
        ``grown_depth``: the depth a model drafter's trees were allowed
        (:meth:`draft_depth`), whose kept nodes' gain by depth it learns (a
        depth the floor stopped growth short of kept nothing);
        ``passes``: the draft passes they took, whose cost the step is judged at."""
        trees, ids, factors = self._calibrated(trees, request_ids, floor)
        p_hat = self.expected(trees, factors)
        batch = len(trees) + plain
        if not self.cost.known(batch):
            return self._cold_choice(trees, p_hat, plain)
        room, per_draft = self.room(len(trees), plain), self.draft_cost(len(trees), passes)
        planned = self.cost.plan(trees, p_hat, factors, plain, per_draft, room)
        without = batch / planned.plain_seconds
        if fallback is not None:
            scorer = fallback_budget or self
            fallback_p_hat = self.expected(fallback, [scorer.calibration(r) for r in ids])
            without = max(without, self.cost.best_rate(fallback_p_hat, plain, room))
        measurable = bool(trees) and per_draft > 0.0
        self.pauses.judge(planned.rate if measurable else None, without, batch, planned.seconds,
                          planned.plain_seconds)
        if grown_depth:
            self.depth.observe_kept(len(trees), *kept_by_depth(planned.trees, factors, grown_depth))
        return Choice(planned.trees, planned.trust_cut)

    def probe(self, trees: list[DraftTree], request_ids: list[str], plain: int = 0) -> list[DraftTree]:
        """Newcomers' trees while drafting is paused (see "Newcomers while
        paused"): what :meth:`choose` would keep of each, and at least its
        best node where the cost model allows one (``cost_models``). Not
        judged by the pause control: a paused step is the rate without
        drafting that the next probe is compared with."""
        trees, _, factors = self._calibrated(trees, request_ids, 0.0)
        if not self.cost.known(len(trees) + plain):
            return [tree.keep_best(1) for tree in trees]
        return self.cost.plan(trees, self.expected(trees, factors), factors, plain, self.draft_cost(),
                              self.room(len(trees), plain), at_least=1).trees

    def _cold_choice(self, trees: list[DraftTree], p_hat, plain: int) -> Choice:
        """Before the fit: the nodes with ``p_hat >= cold_min_p``, and each
        tree's best node on a model drafter's first ``COLD_TRIALS`` steps, a
        trial; a step that keeps none is judged on the mean step time."""
        trial = self.cold_trials < COLD_TRIALS and any(len(v) for v in p_hat)
        self.cold_trials += trial
        wanted = [max(sum(value >= self.cold_min_p for value in v), int(trial and len(v) > 0)) for v in p_hat]
        confident = within(p_hat, wanted, self.room(len(trees), plain))
        chosen = [t.keep_best(count) for t, count in zip(trees, confident)]
        step, per_draft = self.fit.mean_step(), self.draft_cost()
        if trees and not any(len(t) for t in chosen) and step and per_draft > 0.0:
            rows, drafting_step = len(trees) + plain, step + per_draft * len(trees)
            self.pauses.judge(rows / drafting_step, rows / step, rows, drafting_step, step)
        else:
            self.pauses.judge(None, 0.0)
        return Choice(chosen, sum(confident) < sum(wanted))

    def _calibrated(
        self, trees: list[DraftTree], request_ids: list[str] | None, floor: float
    ) -> tuple[list[DraftTree], list[str | None], list[float]]:
        """What every :meth:`choose` starts from: the last measured step
        judged, ``trees`` without their nodes below ``floor``, each
        request's record faded by a step, and each tree's ``factor``."""
        self.pauses.settle()
        if floor > 0.0:
            trees = [tree.at_least(floor) for tree in trees]
        ids = request_ids or [None] * len(trees)
        self.calibrated.fade(ids)
        return trees, ids, [self.calibration(request_id) for request_id in ids]

    def expected(self, trees: list[DraftTree], factors: list[float]):
        """Each tree's ``p_hat`` in keep order, descending (``node_allocation.expected``)."""
        return node_allocation.expected(trees, factors, self.max_nodes)
