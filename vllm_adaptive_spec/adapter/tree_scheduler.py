"""Structured output along tree paths: vLLM's scheduler, told each draft's parent.

vLLM keeps a request's grammar matcher in the scheduler's process and reads
a request's drafts as a chain: it validates them in sequence (a tree's
siblings would be read as successors, and a valid tree cut at its first
branch) and fills one grammar bitmask row per draft, the state after the
drafts before it. With trees, the worker's drafts come with their parents
(:class:`TreeDraftTokenIds`, built by the tree runner), and :class:`TreeScheduler`

* validates a structured request's drafts as a tree (``update_draft_token_ids``):
  a node its grammar forbids, and every node below it, is removed before
  verification (:func:`grammar_kept`, a depth-first walk with the matcher,
  as vLLM validates a chain), the rest keep their tree. The worker learns
  which nodes stayed from the step's scheduler output (``tree_kept``: per
  request whose tree lost nodes, the kept node indices), so it verifies
  exactly that subtree. With uniform steps (``uniform_widths``) the removed
  nodes' places become padding (``-1``), so a step keeps its width;
* fills the bitmask per node (``get_grammar_bitmask``): row 0 the request's
  state, row ``1 + j`` the state after node ``j``'s path, walking the tree
  depth first with the matcher and rolling it back (:func:`tree_rows`). A
  node the grammar forbids, and every node below it, gets a row that allows
  everything (it is never reached, and a row that allows nothing would make
  its logits ``-inf``). The rows keep vLLM's layout (``1 + drafts`` per
  request, in ``structured_output_request_ids`` order), so the worker
  applies them unchanged.

* drafts, for a decoding structured request that has no tree this step
  (the load budget paused, its drafter proposed nothing, or the grammar cut
  every node), the string its grammar forces from its current state
  (:func:`jump_forward_tokens`, jump-forward decoding: after ``{"`` of a
  schema whose first key is ``name``, the ``name"`` that must follow), as
  the tokenizer spells it less its last token, at most
  ``num_speculative_tokens`` tokens, verified as a chain
  (``grammar_forcing``; on by default). The target emits that string
  wherever its own processors allow, so the tokens are accepted unless it
  splits the string otherwise, and each saves the request a step. With
  uniform steps they fill the request's padding; a draft-free step stays
  draft-free, so that its FULL graph replays. The worker verifies them as
  a chain and keeps them out of its drafter's statistics (``tree_forced``).

After the step vLLM advances the matcher by the accepted path and the bonus
token, exactly as after a chain that emitted them. Decision: requests whose
grammar starts later (a reasoning parser's thinking section) get no drafts,
as the bounds vLLM computes for them hold along a chain only.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds

from vllm_adaptive_spec.adapter import ragged_or_uniform
from vllm_adaptive_spec.adapter.config_hook import tree_config_of
from vllm_adaptive_spec.adapter.request_options import speculation_allowed
from vllm_adaptive_spec.step.failures import Failures
from vllm_adaptive_spec.trees.uniform_widths import drafted_nodes


@dataclass
class TreeDraftTokenIds(DraftTokenIds):
    """vLLM's drafts with each request's tree parents (``None``: a chain)."""

    parents: list[list[int] | None]


def grammar_kept(grammar, request_id: str, tokens: list[int], parents: list[int]) -> list[int]:
    """The nodes whose whole path the grammar accepts, ascending (closed
    under ancestors): a forbidden node (or padding ``-1``, or any node once
    the grammar has ended) is cut with its subtree (:func:`_walk`)."""
    kept: list[int] = []
    _walk(grammar, request_id, tokens, _children(parents), kept.append, lambda node: None)
    return sorted(kept)


def jump_forward_tokens(grammar, encode, limit: int) -> list[int]:
    """The string the grammar forces from its current state (xgrammar's
    jump-forward string: a JSON schema's keys and quotes), as the tokenizer
    spells it (``encode``), but its last token, at most ``limit`` tokens.
    Decision: not the last token, which the model mostly merges with what
    follows the string (``name"`` is forced, where whitespace may precede
    the colon, and the model writes ``name`` then ``":"``): replaying the
    demo model's JSON answers, the whole string's tokens were accepted 80
    times of 160, all but the last 80 of 80 (``bench retrieval-calibration``,
    ``jump-forward-whole`` and ``jump-forward``, 2026-11-28;
    ``benchmarks/results/history.md``). A grammar that has ended (``ignore_eos`` decodes past its stop token, as
    vLLM allows) forces nothing, and its matcher is not asked: xgrammar's
    check aborts on a matcher that accepted its stop token."""
    if grammar.is_terminated():
        return []
    text = grammar.matcher.find_jump_forward_string()
    return grammar.validate_tokens(encode(text)[:-1][:limit]) if text else []


def forced_tokens(grammar, request_id: str, scratch: torch.Tensor, limit: int) -> list[int]:
    """The tokens the grammar allows alone, one after another from its
    current state (at most ``limit``), found with its own bitmask (row 0 of
    ``scratch``); the matcher ends where it began. Certain, but a state a
    tokenizer can leave by several tokens (``e`` or ``e"`` at the end of a
    key) forces nothing: the backends without a jump-forward string."""
    forced: list[int] = []
    try:
        while len(forced) < limit and not grammar.is_terminated():
            grammar.fill_bitmask(scratch, 0)
            token = only_token(scratch[0])
            if token is None or grammar.validate_tokens([token]) != [token]:
                break
            grammar.accept_tokens(request_id, [token])
            forced.append(token)
    finally:
        if forced:
            grammar.rollback(len(forced))
    return forced


def only_token(row: torch.Tensor) -> int | None:
    """The one token a bitmask row (32 tokens an int32 word, bit ``t % 32``
    of word ``t // 32``) allows, or None when it allows none or several."""
    words = row.numpy()
    nonzero = np.flatnonzero(words)
    if nonzero.size != 1:
        return None
    word = int(words[nonzero[0]]) & 0xFFFFFFFF
    if word & (word - 1):
        return None
    return int(nonzero[0]) * 32 + word.bit_length() - 1


def without_removed(tokens: list[int], parents: list[int], kept: list[int], pad: bool) -> tuple[list[int], list[int]]:
    """The drafts and parents of the ``kept`` nodes (renumbered); with
    ``pad``, followed by ``-1`` padding up to the drafts' length."""
    index = {old: new for new, old in enumerate(kept)}
    kept_tokens = [tokens[i] for i in kept]
    kept_parents = [-1 if parents[i] < 0 else index[parents[i]] for i in kept]
    return kept_tokens + [-1] * (len(tokens) - len(kept)) * pad, kept_parents


def tree_rows(grammar, request_id: str, tokens: list[int], parents: list[int], fill, allow_all, base: int) -> None:
    """Fill rows ``base + 1 + j`` with the grammar's mask after node ``j``'s
    path (``fill(index)``), or ``allow_all(index)`` where the path leaves the
    grammar (a forbidden token, a token after its end, padding ``-1``): the
    cut node and its subtree (:func:`_walk`)."""
    children = _children(parents)

    def cut(node: int) -> None:
        for below in _subtree(children, node):
            allow_all(base + 1 + below)

    _walk(grammar, request_id, tokens, children, lambda node: fill(base + 1 + node), cut)


def _walk(grammar, request_id: str, tokens: list[int], children: dict[int, list[int]], accepted, cut) -> None:
    """Walk the tree depth first with the matcher: ``accepted(node)`` with
    the matcher just after the node's path, where the grammar accepts the
    whole path; ``cut(node)`` at the first node of a path it does not accept
    (padding ``-1``, a forbidden token, any token after its end), whose
    subtree is not walked. Each accepted token is rolled back, so the
    grammar ends where it began."""

    def walk(node: int) -> None:
        token = tokens[node]
        if token < 0 or grammar.is_terminated() or grammar.validate_tokens([token]) != [token]:
            cut(node)
            return
        grammar.accept_tokens(request_id, [token])
        try:  # the matcher ends where it began even if a step of the walk raises
            accepted(node)
            for child in children.get(node, ()):
                walk(child)
        finally:
            grammar.rollback(1)

    for root_child in children.get(-1, ()):
        walk(root_child)


def _children(parents: list[int]) -> dict[int, list[int]]:
    """Each node's children (the root: -1), in node order."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)
    return children


def _subtree(children: dict[int, list[int]], node: int) -> list[int]:
    """``node`` and every node below it."""
    nodes = [node]
    for below in nodes:
        nodes.extend(children.get(below, ()))
    return nodes


class TreeScheduler(Scheduler):
    """vLLM's scheduler, with grammar drafts and masks per tree node (see the module)."""

    def __init__(self, vllm_config, *args, **kwargs) -> None:
        super().__init__(vllm_config, *args, **kwargs)
        config = tree_config_of(vllm_config)
        self._pad_removed = config is not None and ragged_or_uniform.resolve(config, vllm_config).uniform
        self._forcing_limit = config.max_nodes if config is not None and config.grammar_forcing else 0
        self._scratch_mask: torch.Tensor | None = None  # one bitmask row for ``forced_tokens``
        self._failures = Failures()

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        parents = getattr(draft_token_ids, "parents", None)
        if parents is None:
            return super().update_draft_token_ids(draft_token_ids)
        for req_id, drafts, tree_parents in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, parents):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk:
                request.spec_token_ids = []
                continue
            request.tree_kept = None
            if request.use_structured_output and drafts:
                drafts, tree_parents = self._failures.run(
                    "the grammar's cut of its tree", (req_id,),
                    lambda: self._validated(request, drafts, tree_parents),
                    lambda: self._cut_all(request, drafts))
            request.tree_parents = tree_parents
            request.spec_token_ids = drafts

    def _validated(self, request, drafts: list[int], parents: list[int] | None) -> tuple[list[int], list[int] | None]:
        """A structured request's drafts without the nodes its grammar
        forbids (the kept indices noted on the request for the worker), or
        none where its grammar starts later (a reasoning section: vLLM's
        bounds hold along a chain only) or is not compiled yet."""
        grammar = self._grammar_from_start(request)
        if grammar is None:
            return [], None
        nodes = drafted_nodes(drafts)  # the rest: a uniform step's padding
        parents = list(range(-1, nodes - 1)) if parents is None else parents[:nodes]
        kept = grammar_kept(grammar, request.request_id, drafts, parents)
        if len(kept) == len(parents):
            return drafts, parents
        request.tree_kept = kept
        return without_removed(drafts, parents, kept, self._pad_removed)

    def _cut_all(self, request, drafts: list[int]) -> tuple[list[int], list[int]]:
        """A request's drafts with every node removed (its grammar's cut failed)."""
        request.tree_kept = []
        return [-1] * len(drafts) * self._pad_removed, []

    def schedule(self, *args, **kwargs):
        """vLLM's schedule, with ``tree_kept``: for each request whose tree
        the grammar cut, the node indices (of the worker's tree) its
        scheduled drafts are; and ``tree_forced``: the requests whose drafts
        are their grammar's forced tokens (:meth:`_force_grammar_tokens`)."""
        forced = self._force_grammar_tokens()
        output = super().schedule(*args, **kwargs)
        output.tree_forced = {req_id for req_id in forced if req_id in output.scheduled_spec_decode_tokens}
        output.tree_kept = {}
        for req_id in output.scheduled_spec_decode_tokens:
            kept = getattr(self.requests.get(req_id), "tree_kept", None)
            if kept is not None:
                output.tree_kept[req_id] = kept
        return output

    def _force_grammar_tokens(self) -> set[str]:
        """Each decoding structured request without a tree drafts its
        grammar's forced tokens (:func:`forced_tokens`): in place of its
        padding (``-1``) with uniform steps, else as its drafts; the requests
        that got some."""
        forced: set[str] = set()
        if not self._forcing_limit:
            return forced
        for request in self.running:
            drafts = request.spec_token_ids
            if (not request.use_structured_output or request.num_tokens - request.num_computed_tokens != 1
                    or any(token >= 0 for token in drafts) or (self._pad_removed and not drafts)
                    or not speculation_allowed(request.sampling_params)):
                continue
            grammar = self._grammar_from_start(request)
            if grammar is None:
                continue
            limit = len(drafts) if drafts else self._forcing_limit
            tokens = self._failures.run("grammar forcing", (request.request_id,),
                                        lambda: self._forced(grammar, request.request_id, limit), list)
            if tokens:
                request.spec_token_ids = tokens + list(drafts[len(tokens):])
                request.tree_parents, request.tree_kept = None, None
                forced.add(request.request_id)
        return forced

    def _grammar_from_start(self, request):
        """The request's grammar where it holds from the next token on (the
        bounds vLLM computes are ``(0, 0)``); None where it starts later (a
        reasoning section) or is not compiled yet."""
        grammar = request.structured_output_request.grammar
        bounds = tuple(self.structured_output_manager._get_constraint_bounds(request, ()))
        return grammar if grammar is not None and bounds == (0, 0) else None

    def _forced(self, grammar, request_id: str, limit: int) -> list[int]:
        """:func:`jump_forward_tokens` where the grammar's matcher has a
        jump-forward string (xgrammar, vLLM's default), else :func:`forced_tokens`."""
        manager = self.structured_output_manager
        if hasattr(getattr(grammar, "matcher", None), "find_jump_forward_string"):
            return jump_forward_tokens(grammar, lambda text: manager.tokenizer.encode(text, add_special_tokens=False),
                                       limit)
        if self._scratch_mask is None:
            self._scratch_mask = manager.backend.allocate_token_bitmask(1)
        return forced_tokens(grammar, request_id, self._scratch_mask, limit)

    def get_grammar_bitmask(self, scheduler_output) -> GrammarOutput | None:
        if not scheduler_output.has_structured_output_requests:
            return None
        ids = [req_id for req_id in scheduler_output.num_scheduled_tokens
               if (req := self.requests.get(req_id)) and req.use_structured_output and not req.is_prefill_chunk]
        if not ids:
            return None
        manager, scheduled = self.structured_output_manager, scheduler_output.scheduled_spec_decode_tokens
        bitmask = self._bitmask_rows(manager, ids, scheduled)
        drafts = [sum(1 for token in scheduled.get(req_id, ()) if token >= 0) for req_id in ids]
        return GrammarOutput(ids, bitmask, drafts)

    def _bitmask_rows(self, manager, ids: list[str], scheduled: dict[str, list[int]]):
        """``1 + drafts`` rows per request (:func:`tree_rows`; vLLM's row buffer)."""
        if manager._grammar_bitmask is None:
            rows = self.vllm_config.scheduler_config.max_num_seqs * (1 + self.vllm_config.num_speculative_tokens)
            manager._grammar_bitmask = manager.backend.allocate_token_bitmask(rows)
        buffer, index = manager._grammar_bitmask, 0
        for req_id in ids:
            request, tokens = self.requests[req_id], scheduled.get(req_id, [])
            grammar = request.structured_output_request.grammar
            bounds = tuple(manager._get_constraint_bounds(request, ()))
            manager._fill_bitmasks(((grammar, index, bounds[1] == 0),))
            parents = getattr(request, "tree_parents", None)
            parents = list(range(-1, len(tokens) - 1)) if parents is None else parents[: len(tokens)]
            parents += [-1] * (len(tokens) - len(parents))  # a uniform step's padding (-1): rows that allow all
            tree_rows(grammar, req_id, tokens, parents, lambda row: manager._fill_bitmasks(((grammar, row, True),)),
                      lambda row: buffer[row].fill_(manager._full_mask), index)
            index += 1 + len(tokens)
        return buffer[:index].numpy()
