"""Structured output along tree paths: vLLM's scheduler, told each draft's parent.

vLLM keeps a request's grammar matcher in the scheduler's process and reads
a request's drafts as a chain: it validates them in sequence (a tree's
siblings would be read as successors, and a valid tree cut at its first
branch) and fills one grammar bitmask row per draft, the state after the
drafts before it. With trees, the worker's drafts come with their parents
(:class:`TreeDraftTokenIds`, built by the tree runner), and :class:`TreeScheduler`

* keeps a structured request's whole tree (``update_draft_token_ids``):
  a node its grammar forbids is verified but can never be accepted, since
  its parent's row masks its token out (greedy and sampled verification
  alike, so output stays lossless);
* fills the bitmask per node (``get_grammar_bitmask``): row 0 the request's
  state, row ``1 + j`` the state after node ``j``'s path, walking the tree
  depth first with the matcher and rolling it back (:func:`tree_rows`). A
  node the grammar forbids, and every node below it, gets a row that allows
  everything (it is never reached, and a row that allows nothing would make
  its logits ``-inf``). The rows keep vLLM's layout (``1 + drafts`` per
  request, in ``structured_output_request_ids`` order), so the worker
  applies them unchanged.

After the step vLLM advances the matcher by the accepted path and the bonus
token, exactly as after a chain that emitted them. Decision: requests whose
grammar starts later (a reasoning parser's thinking section) get no drafts,
as the bounds vLLM computes for them hold along a chain only.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm.v1.core.sched.output import GrammarOutput
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.outputs import DraftTokenIds


@dataclass
class TreeDraftTokenIds(DraftTokenIds):
    """vLLM's drafts with each request's tree parents (``None``: a chain)."""

    parents: list[list[int] | None]


def tree_rows(grammar, request_id: str, tokens: list[int], parents: list[int], fill, allow_all, base: int) -> None:
    """Fill rows ``base + 1 + j`` with the grammar's mask after node ``j``'s
    path (``fill(index)``), or ``allow_all(index)`` where the path leaves the
    grammar (a forbidden token, a token after its end, padding ``-1``); the
    grammar ends where it began."""
    children: dict[int, list[int]] = {}
    for node, parent in enumerate(parents):
        children.setdefault(parent, []).append(node)

    def walk(node: int) -> None:
        token = tokens[node]
        if token < 0 or grammar.is_terminated() or grammar.validate_tokens([token]) != [token]:
            for below in _subtree(children, node):
                allow_all(base + 1 + below)
            return
        grammar.accept_tokens(request_id, [token])
        fill(base + 1 + node)
        for child in children.get(node, ()):
            walk(child)
        grammar.rollback(1)

    for root_child in children.get(-1, ()):
        walk(root_child)


def _subtree(children: dict[int, list[int]], node: int) -> list[int]:
    """``node`` and every node below it."""
    nodes = [node]
    for below in nodes:
        nodes.extend(children.get(below, ()))
    return nodes


class TreeScheduler(Scheduler):
    """vLLM's scheduler, with grammar drafts and masks per tree node (see the module)."""

    def update_draft_token_ids(self, draft_token_ids: DraftTokenIds) -> None:
        parents = getattr(draft_token_ids, "parents", None)
        if parents is None:
            return super().update_draft_token_ids(draft_token_ids)
        manager = self.structured_output_manager
        for req_id, drafts, tree_parents in zip(draft_token_ids.req_ids, draft_token_ids.draft_token_ids, parents):
            request = self.requests.get(req_id)
            if request is None or request.is_finished():
                continue
            if request.is_prefill_chunk:
                request.spec_token_ids = []
                continue
            request.tree_parents = tree_parents
            if request.use_structured_output and tuple(manager._get_constraint_bounds(request, ())) != (0, 0):
                drafts = []  # a grammar that starts later: bounds hold along a chain only
            request.spec_token_ids = drafts

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
