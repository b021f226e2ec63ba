"""Proposing a step's trees: the drafter grows each request's tree, its
policy shapes it and the load budget cuts it to the nodes worth verifying at
the measured costs (:meth:`Proposer.propose_trees`); the drafter's paused
part and fill stand in while the budget pauses it. It keeps each request's
last tree, so the runner can lay out the draft tokens vLLM schedules as that
tree, and learns from each verified tree (:meth:`Proposer.observe`). vLLM's
drafter object is the adapter's ``TreeProposer``, this class built from
vLLM's config.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import torch

from vllm_adaptive_spec.budget.cost_fit import StepCostFit
from vllm_adaptive_spec.budget.load_budget import LoadBudget
from vllm_adaptive_spec.budget.pause_control import StepDecision
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.step.failures import Failures
from vllm_adaptive_spec.step.tree_stats import TreeStats
from vllm_adaptive_spec.step.growth import grow, reachable_depth
from vllm_adaptive_spec.trees.tree import DraftTree


class _Part(NamedTuple):
    """What drafts a step's trees: a drafter, its policy and its load budget
    (None: every node verified); ``paused``: the drafter's paused part."""

    drafter: object
    policy: object
    load_budget: LoadBudget | None
    paused: bool


class _StepRequests(NamedTuple):
    """What :meth:`Proposer.propose_trees` is given about the step's requests."""

    request_ids: list[str]
    sampled_token_ids: list[list[int]]
    num_tokens: np.ndarray
    token_ids: np.ndarray
    prompt_lens: np.ndarray | None
    sampled_pending: bool


class FirstPass(NamedTuple):
    """A first pass (:meth:`Proposer.propose_trees`): the batch rows it
    fed for drafting and the seconds the step's drafting is charged (the
    step's own share, or for a fill the whole pass, catch-up included)."""

    rows: set[int]
    seconds: float


class Proposer:
    """The step's proposing, for an engine of tree settings ``config`` in
    step ``mode`` (ragged or uniform) on ``device_type``: requests of at
    most ``max_model_len`` tokens, steps of at most ``max_step_tokens``."""

    def __init__(self, config, mode, device_type: str, max_model_len: int, max_step_tokens: int) -> None:
        self.config = config
        self.drafter = config.make_drafter(device_type)
        self.policy = config.make_policy()
        self.max_model_len = max_model_len
        self.trees: dict[str, DraftTree] = {}
        self.stats = TreeStats()
        self.recorder = None  # called with each verified tree and its accepted nodes (c2t-collect)
        # Ragged or uniform steps (the adapter's ``ragged_or_uniform``), decided once for the engine.
        self.mode = mode
        self.max_step_tokens = max_step_tokens
        # The clock reading the load budget acts on (the engine's runner makes
        # it rank 0's under tensor parallelism, see ``runner.rank0_reading``).
        self.agree: Callable[[float], float] = lambda seconds: seconds
        # What drafts while the load budget pauses the drafter: a part of it that
        # runs no model pass, with its own policy (the hybrid's retrieval trie), or nothing.
        paused_part = getattr(self.drafter, "paused_part", None)
        self._paused_part = (None, None) if paused_part is None else paused_part()
        self._from_paused_part: set[str] = set()  # requests whose last tree came from it
        # What drafts, while the drafter is paused, the requests its paused part left
        # without a tree: the hybrid's model drafter alone (its head where the trie has no match).
        fill_part = getattr(self.drafter, "fill_part", None)
        self._fill_drafter = None if fill_part is None else fill_part()
        self._from_fill: set[str] = set()  # requests whose last tree came from it
        self._verified: set[str] = set()  # requests that have had a tree verified (others are newcomers)
        self.failures = Failures()  # drafting that raised costs the step's trees (``failures``)
        # The step mode's cost model (``cost_models``), shared by the load budgets.
        self.cost = self.mode.cost_model(StepCostFit()) if self.config.load_budget == "adaptive" else None
        self.load_budget, self.paused_budget, self.fill_budget = self._budgets()

    def _budgets(self) -> tuple[LoadBudget | None, LoadBudget | None, LoadBudget | None]:
        """The drafter's load budget, its paused part's and its fill's, over
        the one cost model. Decision: the paused part's drafting is not free
        (drafting every step, the trie's index and growth take 4% of the step
        time at batch 64, where its trees rarely pay), so it pauses on its
        own measured cost, and its trees calibrate its own factor rather than
        the model's; the step's measured costs are shared. The fill's
        budget is the model's decision where the trie has nothing: its
        trees are judged against no drafting, not against the trie (which
        the drafter's own budget judges the merged trees against)."""
        if self.cost is None:
            return None, None, None
        n = self.config.max_nodes
        drafter_budget = LoadBudget(n, self.cost, realized=getattr(self.drafter, "is_model", False))
        paused = LoadBudget(n, self.cost, realized=False) if self._paused_part[0] is not None else None
        fill = LoadBudget(n, self.cost, realized=True) if self._fill_drafter is not None else None
        return drafter_budget, paused, fill

    def may_fill(self, decision: StepDecision) -> bool:
        """Whether a step of ``decision`` may fill (:meth:`propose_trees`'
        ``fill_pass``): a paused step, not a control step, of a drafter that fills."""
        return self._fill_drafter is not None and not decision.drafts and not decision.control

    def forget(self, request_ids, finished=()) -> None:
        """Drop what is kept per request; ``finished`` ones (not preempted)
        may leave their output to the drafter's shared datastore."""
        for request_id in request_ids:
            self.trees.pop(request_id, None)
            self._from_paused_part.discard(request_id)
            self._from_fill.discard(request_id)
            self._verified.discard(request_id)
            self.drafter.forget(request_id, finished=request_id in finished)
            self.policy.forget(request_id)
            for load_budget in self._active_budgets():
                load_budget.forget(request_id)

    def requests_held(self) -> dict[str, int]:
        """How many requests each part keeps state for: all zero once every
        request has finished, been aborted or been preempted."""
        return {
            "trees": len(self.trees.keys() | self._from_paused_part | self._from_fill | self._verified),
            "drafter": self.drafter.requests_held(),
            "policy": self.policy.requests_held(),
            "load_budget": sum(b.requests_held() for b in self._active_budgets()),
        }

    def _active_budgets(self) -> list[LoadBudget]:
        return [b for b in (self.load_budget, self.paused_budget, self.fill_budget) if b is not None]

    def depth_choices(self) -> dict[int, int]:
        """How many drafting steps the load budgets gave each draft depth (a
        model drafter's and its fill's; empty without one)."""
        budgets = [b for b in (self.load_budget, self.fill_budget) if b is not None]
        counts = sum(b.depth.choices for b in budgets) if budgets else []
        return {depth: int(count) for depth, count in enumerate(counts) if count}

    def clear_shared_datastore(self) -> int:
        """Empty the retrieval drafter's shared datastore; the tokens dropped."""
        return self.drafter.clear_shared() if hasattr(self.drafter, "clear_shared") else 0

    def observe(self, request_ids: list[str], trees: list[DraftTree], accepted: list[list[int]]) -> None:
        """Verified trees (possibly cut by the scheduler) and their accepted
        nodes, for the load budget's calibration and the policy's history."""
        self._verified.update(request_ids)
        for request_id, tree, nodes in zip(request_ids, trees, accepted):
            self.stats.leaf_paths += bool(nodes) and nodes[-1] not in tree.parents
            if self.recorder is not None:
                self.recorder(tree, nodes)
            paused = request_id in self._from_paused_part
            load_budget = (self.paused_budget if paused else self.fill_budget if request_id in self._from_fill
                           else self.load_budget)
            if load_budget is not None:
                load_budget.observe_tree(tree, nodes, request_id)
            if not paused:
                self.policy.observe(request_id, tree, len(nodes))

    def observe_step(
        self, step_tokens: int, step_seconds: float, prefill_tokens: int, trees: int = 0, branching: int = 0,
        uniform_rows: int | None = None,
    ) -> None:
        """One engine step's tokens and time, for the cost model the budgets
        share (``uniform_rows``: the rows every request of a decode-only step had)."""
        if self.cost is not None:
            self.cost.observe(step_tokens, step_seconds, prefill_tokens, trees, branching, uniform_rows)

    def begin_step(self) -> StepDecision:
        """What this step does: whether it drafts at all (the load budget may
        pause it) and for how many requests; asked once per step, before any
        draft pass, and handed to :meth:`propose_trees`."""
        return StepDecision(drafts=True) if self.load_budget is None else self.load_budget.begin_step()

    def _drafting_part(self, decision: StepDecision) -> _Part | None:
        """Who drafts this step: the drafter; while the load budget pauses
        it, its paused part (the hybrid's trie) unless that has a budget of
        its own that pauses too; on a control step, nobody."""
        if decision.drafts:
            return _Part(self.drafter, self.policy, self.load_budget, paused=False)
        paused = self._paused_drafting()
        if decision.control or paused is None:
            return None
        if self.paused_budget is not None and not self.paused_budget.begin_step().drafts:
            return None
        return paused

    def _newcomer_part(self) -> _Part | None:
        """Who drafts newcomers' probes while nothing else drafts (see
        :meth:`LoadBudget.probe`): a drafter that runs no model pass, else
        its paused part; a model drafter alone probes on its own schedule
        (``pause_control``), since a probe of its own would need a draft pass."""
        if self.load_budget is None:
            return None
        if not getattr(self.drafter, "is_model", False):
            return _Part(self.drafter, self.policy, self.load_budget, paused=False)
        return self._paused_drafting()

    def _paused_drafting(self) -> _Part | None:
        """The drafter's paused part with its budget, or None without one."""
        drafter, policy = self._paused_part
        return None if drafter is None else _Part(drafter, policy, self.paused_budget, paused=True)

    def _paused_part_trees(self, request_ids: list[str], max_nodes: list[int]) -> list[DraftTree] | None:
        """What the drafter's paused part would draft for these requests this
        step (prepared with the whole drafter), or None without one."""
        drafter, policy = self._paused_part
        if drafter is None:
            return None
        policy.begin(request_ids)
        return grow(drafter, policy, torch.tensor(max_nodes), drafter.max_depth)[0]

    def propose_trees(
        self,
        request_ids: list[str],
        sampled_token_ids: list[list[int]],
        num_tokens: np.ndarray,
        token_ids: np.ndarray,
        eligible: list[bool],
        decision: StepDecision = StepDecision(drafts=True),
        prompt_lens: np.ndarray | None = None,
        sampled_pending: bool = False,
        first_pass_seconds: float = 0.0,
        fill_pass: Callable[[set[int]], FirstPass] | None = None,
    ) -> list[list[int]]:
        """One tree of at most ``N`` nodes per request (empty when it may not
        draft, or when the step's ``decision`` (:meth:`begin_step`) does not
        draft and the drafter has no part that drafts without a model pass),
        cut by the load budget when it is on; returns each tree's tokens,
        breadth-first, as vLLM's draft token ids. ``prompt_lens``: each
        request's prompt length, where a drafter's shared datastore keeps
        outputs only. ``sampled_pending``: ``token_ids`` does not hold this
        step's sampled tokens yet (model drafters run before vLLM's
        bookkeeping), so each context is its committed tokens followed by
        them. ``first_pass_seconds``: a model drafter's pass over this
        step's committed tokens, run before this call; part of the drafting
        cost. ``fill_pass``: on a paused step of a drafter that fills
        (:meth:`may_fill`), the step's first pass, run by the engine for the
        batch rows the fill asks for (see :meth:`_filled`)."""
        fill = self._fill_decision(decision, fill_pass)
        if fill is not None and fill.control:  # a draft-free step for the step-cost fit (``pause_control``)
            decision, fill = decision._replace(control=True), None
        self._count(decision)
        part, newcomers = self._drafting_part(decision), False
        if part is None and not decision.control:
            part, newcomers = self._newcomer_part(), True
        self._from_paused_part.clear()
        self._from_fill.clear()
        step = _StepRequests(request_ids, sampled_token_ids, num_tokens, token_ids, prompt_lens, sampled_pending)
        drafting = [ok and (not newcomers or request_id not in self._verified)
                    for ok, request_id in zip(eligible, request_ids)] if part is not None else [False] * len(eligible)
        drafts = self._part_drafts(part, decision.drafts, newcomers, step, drafting, first_pass_seconds)
        if fill is not None and fill.drafts:
            drafts = self._filled(step, eligible, drafts, fill_pass, fill.limit)
        for request_id, draft in zip(request_ids, drafts):
            if not draft:
                self.trees.pop(request_id, None)
        return self.mode.scheduled(drafts, [bool(sampled) for sampled in sampled_token_ids], self.max_step_tokens)

    def _part_drafts(self, part: _Part | None, drafting: bool, newcomers: bool, step: _StepRequests,
                     eligible: list[bool], first_pass_seconds: float = 0.0) -> list[list[int]]:
        """Each request's draft from ``part`` (empty where it drafts none);
        its trees kept for the runner's layout."""
        drafts: list[list[int]] = [[] for _ in step.request_ids]
        if part is None:  # a paused step of a model drafter: no contexts to gather
            return drafts
        active, max_nodes, contexts = self._drafting_requests(step, eligible)
        if not active:
            return drafts
        active_ids = [step.request_ids[i] for i in active]
        plain = sum(1 for sampled in step.sampled_token_ids if sampled) - len(active)
        lens = None if step.prompt_lens is None else [int(step.prompt_lens[i]) for i in active]
        trees = self._isolated_trees(part, drafting, newcomers, active, active_ids, contexts, max_nodes, lens,
                                     plain, first_pass_seconds)
        drawn = [request_id for request_id, tree in zip(active_ids, trees) if len(tree)]
        if part.paused:
            self._from_paused_part.update(drawn)
            self.stats.paused_trees += len(drawn)
        if newcomers:
            self.stats.newcomer_probes += len(drawn)
        for i, tree in zip(active, trees):
            if len(tree):
                self.trees[step.request_ids[i]] = tree
                drafts[i] = tree.tokens
        return drafts

    def _fill_decision(self, decision: StepDecision, fill_pass) -> StepDecision | None:
        """What the fill does on this step (None: it cannot fill: the
        drafter drafts, or the step is a control step, or the engine gave
        no ``fill_pass``): its budget's decision, taken before the paused
        part drafts, since a control step of the fill's budget is draft-free
        for every part (while the model is paused, its own budget asks for
        none, and the fit and a uniform step's shape table need steps
        without trees); with every node verified, a fill."""
        if fill_pass is None or not self.may_fill(decision):
            return None
        return StepDecision(drafts=True) if self.fill_budget is None else self.fill_budget.begin_step()

    def _filled(self, step: _StepRequests, eligible: list[bool], drafts: list[list[int]],
                fill_pass: Callable[[set[int]], FirstPass], limit: int | None) -> list[list[int]]:
        """The paused step's drafts with the fill's trees added: the model
        drafter alone (the hybrid's head, its depth and nodes chosen by the
        fill's budget against no drafting) for the requests the paused part
        (the trie) left without a tree (at most ``limit``); its first
        pass is run for those rows only, the others staying paused. With every
        node verified (no load budgets), every such request is filled. Decision:
        the trie's trees count as plain rows in the fill's cost, so a fill is
        judged as if the trie's extra rows were free, which they are not at
        large batches, where the fill's own budget then stops it."""
        wanted = [i for i, ok in enumerate(eligible) if ok and step.sampled_token_ids[i] and not drafts[i]]
        wanted = wanted[:limit] if limit is not None else wanted
        if not wanted:
            return drafts
        first = fill_pass(set(wanted))
        part = _Part(self._fill_drafter, self.policy, self.fill_budget, paused=False)
        filled = self._part_drafts(part, False, False, step, [i in first.rows for i in range(len(eligible))],
                                   first.seconds)
        for i, draft in enumerate(filled):
            if draft:
                self._from_fill.add(step.request_ids[i])
                self.stats.fill_trees += 1
        return [draft or fill for draft, fill in zip(drafts, filled)]

    def _count(self, decision: StepDecision) -> None:
        self.stats.proposals += 1
        self.stats.paused += not decision.drafts
        self.stats.controls += decision.control
        self.stats.probes += decision.probing

    def _drafting_requests(self, step: _StepRequests, eligible: list[bool]) -> tuple[list[int], list[int], Contexts]:
        """The batch rows that draft (``eligible`` ones that sampled and have
        room for a node), their node limits ``max_nodes`` and contexts (rows
        of the token array). Plain lists: see ``drafters/contexts``."""
        lengths = step.num_tokens[: len(step.request_ids)].tolist()
        active, max_nodes = [], []
        for row, (sampled, ok, length) in enumerate(zip(step.sampled_token_ids, eligible, lengths)):
            limit = min(self.config.max_nodes, self.max_model_len - length - 1)
            if sampled and ok and limit > 0:
                active.append(row)
                max_nodes.append(limit)
        pending = [step.sampled_token_ids[i] for i in active] if step.sampled_pending else None
        return active, max_nodes, Contexts.gather(step.token_ids, active, [lengths[i] for i in active], pending)

    def _isolated_trees(self, part: _Part, drafting: bool, newcomers: bool, active, active_ids, contexts, max_nodes,
                        lens, plain: int, first_pass_seconds: float) -> list[DraftTree]:
        """:meth:`_grown`, where an exception costs trees, never the engine
        (``failures``): the step's requests are drafted together,
        and if that raises, one by one, so that only a request whose own
        drafting raises goes without a tree. Decision: a model drafter's
        passes serve the step's requests together, so there a failure costs
        the step's trees to all of them."""

        def alone(k: int) -> DraftTree:
            return self._grown(part, drafting, newcomers, [active[k]], [active_ids[k]], contexts.rows([k]),
                               [max_nodes[k]], None if lens is None else [lens[k]], plain + len(active) - 1,
                               first_pass_seconds)[0]

        def one_by_one() -> list[DraftTree]:
            return [self.failures.run("drafting", [active_ids[k]], lambda k=k: alone(k), DraftTree)
                    for k in range(len(active))]

        def together() -> list[DraftTree]:
            return self._grown(part, drafting, newcomers, active, active_ids, contexts, max_nodes, lens, plain,
                               first_pass_seconds)

        if getattr(part.drafter, "is_model", False):
            return self.failures.run("drafting", active_ids, together, lambda: [DraftTree() for _ in active])
        return self.failures.run("drafting a step's trees together", active_ids, together, one_by_one,
                                 then="drafting them one by one")

    def _grown(self, part: _Part, drafting: bool, newcomers: bool, active, active_ids, contexts, max_nodes, lens,
               plain: int, first_pass_seconds: float) -> list[DraftTree]:
        """The drafting requests' trees, grown within the load budget's floor
        and cut by its choice (where it is on); newcomers' probes as the
        budget's :meth:`~LoadBudget.probe` keeps them."""
        started = time.perf_counter()
        drafter, policy, load_budget = part.drafter, part.policy, part.load_budget
        drafter.prepare(active_ids, contexts, active, lens)
        policy.begin(active_ids)
        model = getattr(drafter, "is_model", False)
        depth = reachable_depth(policy, max(max_nodes), drafter.max_depth)
        if model and load_budget is not None and not newcomers:
            depth = load_budget.draft_depth(len(active), plain, depth)
        model_depth = depth if model else 0  # what the load budget learns a model drafter's depths from
        floor = 0.0 if load_budget is None or newcomers else load_budget.floor(len(active), plain, model_depth)
        trees, stats = grow(drafter, policy, torch.tensor(max_nodes), depth, floor)
        passes = stats.draft_passes if model else 0
        self.stats.draft_passes += passes
        if load_budget is None:
            return trees
        drafting_seconds = self.agree(first_pass_seconds + time.perf_counter() - started)
        load_budget.observe_drafting(len(active), drafting_seconds, passes)
        if newcomers:
            return load_budget.probe(trees, active_ids, plain)
        fallback = self._paused_part_trees(active_ids, max_nodes) if drafting else None
        choice = load_budget.choose(trees, active_ids, fallback=fallback, plain=plain,
                                    fallback_budget=self.paused_budget, floor=floor, grown_depth=model_depth,
                                    passes=passes)
        self.stats.trust_cuts += choice.trust_cut
        return choice.trees
