"""The load budget: which drafted nodes are worth verifying this step
(docs/algorithms.md section 8, second version).

Verifying a node is nearly free at batch size 1 and costs real compute once
the batch is large. Every step, after the trees are grown at the full budget
``N``, :class:`LoadBudget` keeps, over the whole batch, the nodes that
maximise the expected committed tokens per second of the next step::

    G / C,   G = B + sum of kept nodes' p_hat,
             C = alpha + beta * (B + n_kept) + delta * B_drafting

* ``p_hat = rho_r * p``: ``p`` is the node's path probability (for the
  retrieval drafter, a calibrated chance of acceptance), ``rho`` the ratio of
  accepted nodes to the sum of ``p`` over verified nodes, measured online, so
  a drafter whose ``p`` is optimistic is discounted. ``rho_r`` is request
  ``r``'s own ratio, shrunk toward the engine's ``rho``:
  ``(a_r + k * rho) / (P_r + k)`` with ``a_r``, ``P_r`` its accepted and
  predicted nodes (decayed per step, half-life ``request_half_life``) and
  ``k = request_prior``; a request whose trees are accepted deeply keeps
  more nodes than one whose trees fail on the same evidence.
* ``alpha + beta * T``: the step time for ``T`` decode rows, from the
  engine's :class:`~vllm_adaptive_spec.step_cost.StepCostFit` (fixed cost,
  per-row cost, and prompt-chunk tokens with a slope of their own), one fit
  shared by the engine's budgets;
  ``delta``: the drafter's measured time per drafting request.
  Decision: a step's prompt chunks are left out of ``C``. They are work the
  engine does whatever is drafted, so they do not make a node cheaper: a node
  costs ``beta`` and saves ``p_hat`` decode rows at ``beta + alpha / B``
  each. Counted in, a prefill-heavy step would keep nearly every node
  offered (measured at batch 64: 133 nodes a step in such steps, 7 in the
  others).
* ``eta``: what verifying a tree costs beyond its rows (layout, verification,
  KV compaction), fitted in the same regression with the step's number of
  trees as a fourth column. Decision: without it that cost lands in
  ``beta`` and the budget trims nodes while still paying it; with it a
  request's tree is kept only when its nodes' net return pays ``eta``.

A ratio of sums over nodes that each add ``p_hat`` to ``G`` and ``beta`` to
``C`` is maximised by keeping exactly the nodes with ``p_hat`` above
``beta * G / C`` at the optimum, found greedily in descending ``p_hat``
(adding a node raises the ratio iff ``p_hat > beta * G / C``). Since ``p``
never rises along a path, the kept set of each tree is closed under
ancestors. Budgets are per request: a request whose trees are confident and
whose record is good keeps many nodes, one with thin evidence or a poor
record none.

Down to no speculation: drafting itself costs ``delta`` per request. Each
measured step compares its rate with the kept nodes (and the drafting) to the
rate without drafting (for the hybrid drafter: the better of no drafting and
its retrieval trie alone, which drafts while the model is paused, under a
budget of its own). Over windows of ``pause_after`` such steps the relative
gains are summed; a window that did not pay pauses drafting for
``pause_steps`` steps, then drafts one step to look (a probe): a probe that
does not pay pauses again at once, for twice as long (up to ``max_pause``).
A window pauses before its end once its losses add up to what one clear loss
costs (below, ``1 - clear_loss`` of a step): a model drafter that loses 15%
of every step at batch 1 pauses after 4 steps, not 16. Decision: a window,
not ``pause_after`` losing steps in a row. Where the gain hovers around zero,
wins and losses alternate step by step (measured: the hybrid's trie at batch
32 lost on 83 of 138 steps, never 16 in a row) and a run-length rule never
pauses a drafter that loses on balance; its real cost then also carries what
the fit does not see (at batch 32, 10% of the step time for 2% more tokens).

A model drafter's window (``realized``) is judged on the tokens its steps
committed, not on those they were expected to commit: each step's realized
rate, ``B`` plus its trees' accepted nodes over the step's modelled cost, is
known once its trees are verified (:meth:`observe_tree`), and the window pays
only if the realized relative gains sum to at least zero, with what drafting
adds to the modelled cost (drafting, the trees' rows and their own costs)
taken ``1 + margin`` times. The early decisions (a probe, a clear loss,
losses adding up to one) stay on the expectation: they must be taken when
the step is chosen, and a drafter that expects to lose does.

Decision: the expectation is biased upward where it picks nodes. A node is
kept when its ``p_hat`` is high, and ``p_hat`` is high after lucky trees (a
request's own record) as often as for good ones: an EAGLE-3 head with C2T at
batch 1 on the CPU expected +10.6% per drafting step and realized -8% to 0%
of the engine without speculation (1.78 tokens a step expected, 1.65 committed), though its
calibration over the run was right (176.6 nodes predicted, 179 accepted).
``margin`` (25%) covers what the model of the step misses: there a plain
step was fitted at 44.4 ms while a step of the engine without speculation
took 40-42 ms, and drafting added 26.8 ms by the fit and 29.5-31 ms measured,
so the drafter's realized +3% against the fit was a loss of 5-9% (with the
margin: -6%). Decision: a share of what drafting adds, not of the step. A flat
5% of the step, charged on every measured step, also charged the steps where
a retrieval trie drafts nothing and spends nearly nothing, and paused the
hybrid's trie at batch 1 where it doubles the speed (measured: 1.82x to
1.69x, trees on 31% to 24% of request steps).

Decision: a retrieval drafter's windows (and the hybrid's trie's) stay
judged on the expectation. It drafts for next to nothing, so a window it
loses costs only its rejected rows, which its calibration ``rho`` already
answers by keeping fewer nodes, while a pause skips whatever it would have
drafted, and its gains come in bursts (a prompt repeated, a list continued)
that a pause of up to ``max_pause`` steps misses. Judged on its committed
tokens it paused more at batch 1 (trees on 41% of request steps, not 52%)
and ran 1.95x of no speculation instead of 2.07x (three retrieval cells,
two passes each); a model drafter's lost window costs its draft passes.

A probe drafts for at most ``probe_requests`` requests (the engine picks
those whose draft state needs the least catch-up; the others count as plain
rows of the step): a paused EAGLE-3 head must first feed every row it kept,
which for a probe over the whole batch at batch 64 costs 6% of the step
time. Decision: one probe, not ``pause_after`` steps, since a model drafter's
tree costs several draft passes however few of its nodes are kept; and a
step whose expected rate with drafting is below ``clear_loss`` times the
rate without pauses at once: at batch 16 an EAGLE-2 tree of a draft LM
costs about ten plain steps (measured: 76 ms per request), so waiting for
``pause_after`` such steps would cost more than a fifth of the run.

A probe costs what a drafting step costs, and a model drafter's can cost
many plain steps: it first catches the draft model up over the paused rows
of the requests it drafts for, then grows their trees to the policy's full
depth. So a pause lasts at least long enough that one more such step adds
at most ``probe_share`` (1%) to the paused steps' time: the pause is the
longer of the doubling schedule and the last drafting step's seconds over
``probe_share`` of a plain step, up to ``max_probe_pause`` steps. Measured
(batch 8, CPU, 78 ms steps): a draft LM's probe with EAGLE-2 at depth 18
took 1.26 s, at depth 8 0.73 s: one probe every ``max_pause`` = 512
steps costs the paused engine 3.1% and 1.8%, one every 1,600 and 940 steps
(this rule) 1%. Decision: a share of the paused time, not a longer
``max_pause`` for every drafter, since a cheap drafter (an EAGLE-3 head's
probe, a retrieval trie's) should look again soon: its load may have
fallen to where it pays.

Slow start: a model drafter drafts for every request only once it has paid
over a whole window; until then (from the engine's start, and again after
every pause) each drafting step drafts, like a probe, for at most
``probe_requests`` requests (:meth:`draft_limit`), and its steps are judged
by the same windows. Decision: a fresh drafter's first trees are trials
while the step-cost fit is unknown and are then judged over a window of
``pause_after`` steps; drafting an EAGLE-3 head's trees for all 32 requests
of a fresh server through those steps cost its first 100 requests a quarter
of their time (measured: the hybrid's first pass over 32 prompts 15.2 s, the
same pass warm 10.6 s, no speculation 11.4 s), and a drafter that pays for
4 requests pays at least as much per request for more, since they share its
passes.

Control steps: the step-cost fit tells a verified tree's own cost (``eta``)
from the fixed cost ``alpha`` only if it sees decode steps without trees.
When every step drafts for every request (a model drafter at batch 1), it
would not, and the tree's cost would be read into ``alpha``: the rate without
drafting would look lower than it is (at batch 1 on the CPU by a fifth) and a
drafter that does not pay would go on drafting. So while the number of trees
per step varies too little for the fit (:meth:`StepCostFit.tree_spread`
below ``CONTROL_SPREAD``), at most one step in ``CONTROL_GAP`` drafts
nothing at all (a control step; with every request drafting every step, about
one step in 50 settles there). Where the trees per step vary on their own
(retrieval trees, which only some requests draft), no control step runs.

Shape: a branching tree may cost more than a chain of the same size (on
vLLM's CPU platform a chain runs in vLLM's own attention kernel and a
branching tree in the plugin's tree path). ``xi``, that extra time per
branching tree, is a fifth column of the same regression (the step's number
of branching trees); a tree keeps its nodes off the main path only when
their expected tokens, net of their rows' cost at the step's rate, exceed it.
Decision: fitted, not timed around the tree path, since in a pass of tree
rows only vLLM's kernel does not run at all and the tree path's whole time
(19 ms a step at batch 1, measured) is then mostly what the same rows cost
as a chain; until branching trees have been seen ``xi`` is 0, so they are
tried and then measured.

Trust region: the fit is linear in decode rows and known only over the steps
it has measured; a step keeps at most as many nodes as bring its decode rows
to ``ROW_GROWTH`` times the most any measured step had, the best over the
batch (:meth:`room`), and at least one whole tree (``max_budget`` nodes).
Decision: a batch that jumps (batch 8 to 64, measured) would otherwise be
judged by a fit of its smaller steps: a DEAGLE tree for each of 64 requests
was kept whole, 2,112 rows, one 2.4 s step on the CPU. On a GPU rows are
close to free up to the device's width and then cost in full, which a line
through the narrower steps cannot know. Each step at the limit is measured,
so the limit doubles per step while the nodes pay, like TCP's slow start.

Decision: before ``StepCostFit.MIN_STEPS`` measured steps, or when the fit is degenerate,
nodes with ``p_hat >= cold_min_p`` are kept (a cautious default). Such a step
is a trial, not judged: verifying its nodes gives the fit the varied steps it
needs. A step that keeps no node is judged all the same: its rate with
drafting is ``B / (T + delta * B_drafting)`` against ``B / T`` without, ``T``
the mean step time, which needs no split of ``T`` into ``alpha`` and
``beta``. Without that, a drafter that is never confident enough for a trial
would keep every step at one shape, the fit degenerate and its drafting
unpaused forever.
"""

from __future__ import annotations

import math
import sys

import numpy as np

from vllm_adaptive_spec.step_cost import StepCostFit
from vllm_adaptive_spec.tree import DraftTree

MIN_RHO, MAX_RHO = 0.05, 2.0  # the calibration's range
FLOOR_MARGIN = 0.8
CONTROL_SPREAD, CONTROL_GAP = 0.02, 16  # see "Control steps"
ROW_GROWTH = 2  # see "Trust region"


def allocate(
    p_hat: list[np.ndarray], alpha: float, beta: float, fixed_cost: float = 0.0, plain: int = 0
) -> list[int]:
    """Nodes to keep per request: ``p_hat[r]`` holds request ``r``'s expected
    acceptances in its keep order (descending); returns how many of each
    maximise ``(B + plain + kept p_hat) / (alpha + fixed_cost + beta * (B + plain + kept))``
    (``plain``: requests of the step that decode one row without a tree)."""
    batch = len(p_hat)
    gain = float(batch + plain)
    cost = alpha + fixed_cost + beta * (batch + plain)
    if batch == 0:
        return []
    values, owners, order = _pooled(p_hat)
    kept = np.zeros(batch, dtype=np.int64)
    for index in order:
        value = values[index]
        if value <= 0 or value * cost <= beta * gain:
            break
        gain += value
        cost += beta
        kept[owners[index]] += 1
    return kept.tolist()


def _pooled(p_hat: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Every request's values in one array, each value's request, and the
    order of the values from the largest (stable among equals)."""
    values = np.concatenate([np.asarray(v, dtype=np.float64) for v in p_hat])
    owners = np.concatenate([np.full(len(v), r) for r, v in enumerate(p_hat)]).astype(np.int64)
    return values, owners, np.argsort(-values, kind="stable")


def within(p_hat: list[np.ndarray], kept: list[int], room: int) -> list[int]:
    """``kept`` cut to the ``room`` best nodes over all requests (each
    request's first ``kept[r]`` of ``p_hat[r]``, which are in descending
    order, so every request keeps a prefix of its own)."""
    if sum(kept) <= room:
        return list(kept)
    _, owners, order = _pooled([v[:k] for v, k in zip(p_hat, kept)])
    return np.bincount(owners[order[: max(room, 0)]], minlength=len(kept)).tolist()


def _at_least(tree: DraftTree, floor: float) -> DraftTree:
    """The nodes of ``tree`` whose path probability is at least ``floor``
    (closed under ancestors, as ``p`` never rises along a path); the tree
    itself when that is all of them."""
    kept = [i for i, p in enumerate(tree.path_probabilities()) if p >= floor]
    return tree if len(kept) == len(tree) else tree.subset(kept)


class LoadBudget:
    def __init__(
        self,
        max_budget: int,
        fit: StepCostFit | None = None,
        half_life: float = 200.0,
        cold_min_p: float = 0.3,
        pause_after: int = 16,
        clear_loss: float = 0.5,
        pause_steps: int = 16,
        max_pause: int = 512,
        request_half_life: float = 32.0,
        request_prior: float = 4.0,
        probe_requests: int = 4,
        margin: float = 0.25,
        realized: bool = True,
        probe_share: float = 0.01,
        max_probe_pause: int = 8192,
    ) -> None:
        self.max_budget = max_budget
        self.probe_requests = probe_requests
        self.decay = 0.5 ** (1.0 / half_life)
        self.cold_min_p = cold_min_p
        self.fit = fit if fit is not None else StepCostFit(half_life)
        self.predicted = 1.0  # decayed sums for rho = accepted / predicted
        self.accepted_nodes = 1.0
        self.request_decay = 0.5 ** (1.0 / request_half_life)
        self.request_prior = request_prior
        self._requests: dict[str, list[float]] = {}  # request -> [predicted, accepted], decayed
        self.draft_seconds = 0.0  # decayed drafter time and drafting requests
        self.drafted_requests = 0.0
        self.pause_after, self.pause_steps, self.max_pause = pause_after, pause_steps, max_pause
        self.clear_loss, self.margin, self.realized = clear_loss, margin, realized
        self.probe_share, self.max_probe_pause = probe_share, max_probe_pause
        self._last_drafting = 0.0  # seconds the last drafting step took (see "A probe costs")
        self._plain_step = 0.0  # the modelled seconds of a plain step like the last measured one
        self._window_steps = 0  # measured steps in the current window, their summed expected relative gain,
        self._window_gain = 0.0
        self._window_realized = 0.0  # and their summed realized gains
        # the last measured step: [tokens, modelled seconds, of them a plain step's, rate without]
        self._pending: list[float] | None = None
        self._paused = 0
        self._next_pause = pause_steps
        self._probing = False  # the step after a pause
        self._proven = False  # drafting paid over a whole window since the start or the last pause
        self._step_floor = 0.0  # what floor() told this step's drafter; choose() applies and clears it
        self._since_control = 0
        self.control = False  # this step is a control step (drafts nothing)
        self.trust_cut = False  # the last choose() kept fewer nodes than it would have without the trust region

    # -- measurements -------------------------------------------------------

    def observe_tree(self, tree: DraftTree, accepted_nodes: list[int], request_id: str | None = None) -> None:
        """A verified tree (of ``request_id``) and the indices of its accepted nodes."""
        predicted = sum(tree.path_probabilities())
        if self._pending is not None:
            self._pending[0] += len(accepted_nodes)
        self.predicted = self.predicted * self.decay + predicted
        self.accepted_nodes = self.accepted_nodes * self.decay + len(accepted_nodes)
        if request_id is not None:
            record = self._requests.setdefault(request_id, [0.0, 0.0])
            record[0] += predicted
            record[1] += len(accepted_nodes)

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted."""
        self._requests.pop(request_id, None)

    def requests_held(self) -> int:
        return len(self._requests)

    def observe_drafting(self, requests: int, seconds: float) -> None:
        """The drafter grew ``requests`` trees in ``seconds``."""
        self.draft_seconds = self.draft_seconds * self.decay + seconds
        self.drafted_requests = self.drafted_requests * self.decay + requests
        self._last_drafting = seconds

    def calibration(self, request_id: str | None = None) -> float:
        """``rho``: accepted nodes per unit of predicted acceptance, the
        engine's, or request ``request_id``'s own shrunk toward it."""
        rho = float(np.clip(self.accepted_nodes / max(self.predicted, 1e-9), MIN_RHO, MAX_RHO))
        record = self._requests.get(request_id)
        if record is None:
            return rho
        predicted, accepted = record
        return float(np.clip((accepted + self.request_prior * rho) / (predicted + self.request_prior), MIN_RHO, MAX_RHO))

    def draft_cost(self) -> float:
        """Seconds of drafting per drafting request."""
        return self.draft_seconds / self.drafted_requests if self.drafted_requests > 1e-9 else 0.0

    # -- decisions ----------------------------------------------------------

    def floor(self, requests: int, plain: int = 0) -> float:
        """A path probability below which the next :meth:`choose` keeps no
        node, for a step with ``requests`` drafting and ``plain`` other
        decoding requests. Decision: the drafter leaves such nodes out of its
        trees (at batch 64 most of them), so they are neither built nor
        ranked.

        The value is ``FLOOR_MARGIN`` times a bound on what :meth:`choose`
        keeps at the current costs, whatever the requests' records: a node
        is kept only if its ``p_hat`` exceeds ``beta`` times the expected
        rate, which adding nodes only raises above the rate with none, and
        ``p_hat <= MAX_RHO * p``. The step's own drafting time enters
        ``delta`` between this call and :meth:`choose` and lowers that rate;
        the margin covers a rise of up to 25% in the step time the rate is
        computed from (``alpha + delta * requests + beta * rows``).
        Decision: the guarantee does not rest on the margin. The value is
        kept for the step and :meth:`choose` drops the nodes below it before
        cutting, so a step whose drafting took far longer than the recent
        ones is chosen from the same nodes whether the drafter left them out
        or not; within the margin the re-check removes only nodes
        :meth:`choose` would not keep, so it changes no choice."""
        fit = self.fit.solve()
        if fit is None:
            floor = FLOOR_MARGIN * self.cold_min_p / MAX_RHO
        else:
            alpha, beta = fit[0], fit[1]
            rows = requests + plain
            rate = rows / (alpha + self.draft_cost() * requests + beta * rows)
            floor = FLOOR_MARGIN * beta * rate / MAX_RHO
        self._step_floor = floor
        return floor

    def drafts(self) -> bool:
        """Whether this step drafts at all: False while paused, and on a
        control step (:attr:`control`; see "Control steps"). The step
        before it, verified by now, is judged first (:meth:`_settle`)."""
        self._settle()
        self.control = False
        if self._paused > 0:
            self._paused -= 1
            self._probing = self._paused == 0
            return False
        self._since_control += 1
        if (self.fit.steps_seen >= StepCostFit.MIN_STEPS and self.fit.tree_spread() < CONTROL_SPREAD
                and self._since_control >= CONTROL_GAP):
            self._since_control = 0
            self.control = True
            return False
        return True

    @property
    def probing(self) -> bool:
        """Whether this drafting step is a probe (the first after a pause)."""
        return self._probing

    def draft_limit(self) -> int | None:
        """How many requests a model drafter may draft for this step:
        ``probe_requests`` on a probe and until drafting has paid over a
        whole window (see "Slow start"), else None (all)."""
        return None if self._proven else self.probe_requests  # a probe follows a pause, which unproves

    def room(self, requests: int, plain: int = 0) -> int:
        """How many drafted nodes a step with ``requests`` drafting and
        ``plain`` other decoding requests may verify: its decode rows stay
        within ``ROW_GROWTH`` times the most the step-cost fit has measured,
        and one whole tree (``max_budget`` nodes) is always allowed (see
        "Trust region"); unbounded before the first measured step."""
        if self.fit.max_rows <= 0:
            return sys.maxsize
        return max(ROW_GROWTH * self.fit.max_rows - requests - plain, self.max_budget)

    def choose(
        self, trees: list[DraftTree], request_ids: list[str] | None = None,
        fallback: list[DraftTree] | None = None, plain: int = 0, fallback_budget: LoadBudget | None = None,
    ) -> list[DraftTree]:
        """The part of each grown tree worth verifying: its best nodes by path
        probability (:meth:`DraftTree.keep_best`), cut to its main path when
        the nodes off that path do not pay for the extra cost of a branching
        tree (:meth:`StepCostFit.branch_cost`). ``request_ids``: the trees' requests, whose
        own records calibrate them (:meth:`calibration`). ``fallback``: the
        same requests' trees from the part of the drafter that runs while the
        drafter is paused (the hybrid's retrieval trie), which drafting is
        judged against (the hybrid's model pays only if it beats retrieval alone),
        calibrated by that part's own budget ``fallback_budget`` (default: this one).
        ``plain``: the step's other decoding requests (one row, one token each).
        The nodes of ``trees`` below the :meth:`floor` handed out for this
        step are dropped first (the floor then expires), so no node below it
        is kept whatever this step's drafting time turned out to be."""
        trees, ids, rhos = self._calibrated(trees, request_ids)
        p_hat = self.expected(trees, rhos)
        fit = self.fit.solve()
        if fit is None:
            wanted = [int((v >= self.cold_min_p).sum()) for v in p_hat]
            confident = within(p_hat, wanted, self.room(len(trees), plain))
            self.trust_cut = sum(confident) < sum(wanted)
            chosen = [t.keep_best(count) for t, count in zip(trees, confident)]
            step, delta = self.fit.mean_step(), self.draft_cost()
            if trees and not any(len(t) for t in chosen) and step and delta > 0.0:
                rows, drafting_step = len(trees) + plain, step + delta * len(trees)
                self._account(rows / drafting_step, rows / step, rows, drafting_step, step)
            else:
                self._account(None, 0.0)
            return chosen
        alpha, beta, _, eta, xi = fit

        def plan(p_hat: list[np.ndarray], delta: float) -> tuple[list[int], float, float, bool]:
            """Nodes kept per tree, the rate the trees were cut at, the
            expected committed tokens per second with the kept nodes, and
            whether the trust region cut them."""
            n = len(p_hat)

            def expected_rate(kept: list[int]) -> float:
                gain = n + plain + sum(float(v[:k].sum()) for v, k in zip(p_hat, kept))
                return gain / (alpha + delta * n + beta * (n + plain + sum(kept)) + eta * sum(k > 0 for k in kept))

            wanted = allocate(p_hat, alpha, beta, delta * n, plain)
            kept = within(p_hat, wanted, self.room(n, plain))
            cut = sum(kept) < sum(wanted)
            for _ in range(2):  # drop the trees whose nodes do not pay eta, at the resulting rate
                rate = expected_rate(kept)
                kept = [k if float(v[:k].sum()) - beta * k * rate >= eta * rate else 0 for v, k in zip(p_hat, kept)]
            return kept, rate, expected_rate(kept), cut

        delta = self.draft_cost()
        kept, rate, with_drafting, self.trust_cut = plan(p_hat, delta)
        chosen = []
        for tree, count, rho in zip(trees, kept, rhos):
            tree = tree.keep_best(count)
            if tree.branches():
                path = tree.main_path()
                off_path = sorted(tree.path_probabilities(), reverse=True)[len(path):]
                net = sum(rho * p - beta * rate for p in off_path)
                if net < xi * rate:
                    tree = path
            chosen.append(tree)
        plain_seconds = alpha + beta * (len(trees) + plain)
        without = (len(trees) + plain) / plain_seconds
        if fallback is not None:
            scorer = fallback_budget or self
            without = max(without, plan(self.expected(fallback, [scorer.calibration(r) for r in ids]), 0.0)[2])
        measurable = bool(trees) and delta > 0.0
        seconds = 0.0
        if self.realized:  # the step's modelled cost, for judging it on what it commits (_settle)
            seconds = (plain_seconds + delta * len(trees) + beta * sum(len(t) for t in chosen)
                       + eta * sum(1 for t in chosen if len(t)) + xi * sum(1 for t in chosen if t.branches()))
        self._account(with_drafting if measurable else None, without, len(trees) + plain, seconds, plain_seconds)
        return chosen

    def _calibrated(
        self, trees: list[DraftTree], request_ids: list[str] | None
    ) -> tuple[list[DraftTree], list[str | None], list[float]]:
        """What every :meth:`choose` starts from: the last measured step
        judged, ``trees`` without their nodes below this step's floor (which
        then expires), each request's record faded by a step, and each
        tree's calibration ``rho``."""
        self._settle()
        step_floor, self._step_floor = self._step_floor, 0.0
        if step_floor > 0.0:
            trees = [_at_least(tree, step_floor) for tree in trees]
        ids = request_ids or [None] * len(trees)
        for request_id in ids:  # a request's record fades a step at a time, verified or not
            record = self._requests.get(request_id)
            if record is not None:
                record[0] *= self.request_decay
                record[1] *= self.request_decay
        return trees, ids, [self.calibration(request_id) for request_id in ids]

    def expected(self, trees: list[DraftTree], rhos: list[float]) -> list[np.ndarray]:
        """Each tree's ``p_hat`` (path probability times ``rho``) in keep order, descending."""
        return [np.sort(np.asarray(t.path_probabilities(), dtype=np.float64))[::-1][: self.max_budget] * rho
                for t, rho in zip(trees, rhos)]

    def _account(
        self, with_drafting: float | None, without: float, tokens: int = 0, seconds: float = 0.0,
        plain_seconds: float = 0.0,
    ) -> None:
        """Take a step's expected rate ``with_drafting`` (None: not
        measurable yet) against the rate ``without`` drafting: pause drafting
        on a probe that expects to lose, on one clear loss (below
        ``clear_loss`` times the rate without), or once the window's expected
        relative gains sum below ``clear_loss - 1`` (its losses add up to one
        clear loss). With ``realized``, the step is then judged by what it
        commits once verified (:meth:`_settle`): ``tokens`` committed without
        a node accepted, in the modelled ``seconds``, of which
        ``plain_seconds`` a step without drafting; else a window ends on the
        expected gains."""
        probing, self._probing = self._probing, False
        self._pending = None
        if with_drafting is None:
            return
        self._plain_step = plain_seconds
        gain = with_drafting / without - 1.0 if without > 0.0 else 0.0
        self._window_steps += 1
        self._window_gain += gain
        if (probing and gain < 0.0) or with_drafting < self.clear_loss * without \
                or self._window_gain < self.clear_loss - 1.0:
            self._pause()
        elif self.realized:
            self._pending = [float(tokens), seconds, plain_seconds, without]
        else:
            self._close_window(self._window_gain)

    def _settle(self) -> None:
        """Judge the last measured step by its realized relative gain once its
        trees' acceptances are in, what drafting added to its modelled cost
        taken ``1 + margin`` times, and close the window on the realized
        gains (:meth:`_close_window`)."""
        if self._pending is None:
            return
        tokens, seconds, plain_seconds, without = self._pending
        self._pending = None
        seconds = plain_seconds + (1.0 + self.margin) * max(seconds - plain_seconds, 0.0)
        realized = tokens / seconds if seconds > 0.0 else 0.0
        self._window_realized += realized / without - 1.0 if without > 0.0 else 0.0
        self._close_window(self._window_realized)

    def _close_window(self, gains: float) -> None:
        """At the end of a window of ``pause_after`` steps whose relative
        gains sum to ``gains``: pause drafting if they are below zero, else
        draft on (for every request: proven)."""
        if self._window_steps < self.pause_after:
            return
        if gains < 0.0:
            self._pause()
        else:
            self._reset_window()
            self._next_pause = self.pause_steps
            self._proven = True

    def _reset_window(self) -> None:
        self._window_steps, self._window_gain, self._window_realized = 0, 0.0, 0.0

    def _pause(self) -> None:
        """Pause drafting for the next pause of the doubling schedule, or
        longer where one more drafting step like the last would cost more
        than ``probe_share`` of the paused steps (see "A probe costs")."""
        self._paused = self._next_pause
        if self._plain_step > 0.0 and self._last_drafting > 0.0:
            costly = math.ceil(self._last_drafting / (self.probe_share * self._plain_step))
            self._paused = max(self._paused, min(costly, self.max_probe_pause))
        self._proven = False
        self._next_pause = min(2 * self._next_pause, self.max_pause)
        self._pending = None
        self._reset_window()
