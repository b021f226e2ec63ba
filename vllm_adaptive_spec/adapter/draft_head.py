"""An EAGLE-3 head as the tree drafter's draft model (``eagle3``).

The head reads the target's auxiliary hidden states: its first pass pairs
those of position ``p`` with token ``p + 1`` (the last row reads the token
after the chain), and each tree node reads its parent's output hidden state
(the root's: the first pass's last row). Those states exist only during
their own step, so a paused head keeps its rows (:class:`PausedRows`) and
feeds them when drafting resumes. Its LM head covers a reduced vocabulary,
mapped to the target's (``d2t``).
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaptive_spec.adapter.draft_backend import Committed, CommittedPass, PagedDraftBackend, PassRows, TreeScratch
from vllm_adaptive_spec.trees.packed_ranges import packed_ranges
from vllm_adaptive_spec.trees.paused_rows import PausedRows


def _kept_first(following, hidden, source, own, first, kept):
    """A catch-up: the step's rows (``following``, ``hidden``) and the
    drafting requests' rows kept from paused steps (``kept``: each request's
    :meth:`PausedRows.take`) in one tensor each, the index that puts each
    request's kept rows before its ``own`` rows (at ``source``), and how many
    rows each request kept."""
    back = np.array([0 if k is None else int(p0) - k[0] for p0, k in zip(first.tolist(), kept)], dtype=np.int64)
    parts, step_rows = [k for k in kept if k is not None], following.shape[0]
    following = torch.cat([following, *(t for k in parts for t in k[1])])
    hidden = torch.cat([hidden, *(h for k in parts for h in k[2])])
    total = own + back
    offsets, kept_offsets = np.cumsum(total) - total, step_rows + np.cumsum(back) - back
    index = np.empty(int(total.sum()), dtype=np.int64)
    index[packed_ranges(offsets, back)] = packed_ranges(kept_offsets, back)
    index[packed_ranges(offsets + back, own)] = source
    return following, hidden, index, back


class HeadDraftBackend(PagedDraftBackend):
    # Bytes of paused steps' rows kept (all requests; see paused_rows.py):
    # 9,700 rows of the demo model (float32, three 576-wide hidden states),
    # 2,700 of an 8B model in bf16. Beyond it the requests keeping the most
    # rows give theirs up (until half of it is left), and with them the
    # head's drafts for the rest of their lives. Decision: not fed instead. A
    # head paused that long is one that does not pay, and feeding the rows
    # anyway would run it over every prompt the server receives (under load
    # on the CPU, a tenth of the server's time); a request that finishes
    # while paused is never fed: its rows cost only their gather.
    STASH_BYTES = 64 << 20

    def __init__(self, runner, native, max_nodes: int, layers=None) -> None:
        super().__init__(runner, native, max_nodes, layers)
        self._draft_vocab: torch.Tensor | None = None  # see _target_ids
        self.paused_rows = PausedRows(self.STASH_BYTES)  # rows of paused steps, not yet fed

    def forget(self, request_ids) -> None:
        self.paused_rows.drop(request_ids)

    def requests_held(self) -> int:
        """Requests whose rows are kept, or that gave them up."""
        return self.paused_rows.requests_held()

    def can_draft(self, request_id: str) -> bool:
        """False once the request gave up its kept rows: its draft KV would have a hole."""
        return request_id not in self.paused_rows.given_up

    def _behind(self, request_id: str, length: int) -> int:
        if request_id in self.paused_rows.given_up:
            return 1 << 62
        return self.paused_rows.rows(request_id)

    def _committed_pass(self, committed: Committed, aux_hidden_states) -> CommittedPass:
        """The step's rows of every request, gathered for the whole batch at
        once: each row's input token (the next one; the last row's is the
        token after the chain) and the target's auxiliary hidden states.
        Paused requests' rows are kept as one block (:meth:`PausedRows.keep`:
        a paused step costs these gathers, not an operation per request);
        drafting ones go into the pass, after the rows they kept, in one
        gather from the step's rows and the kept ones."""
        committed = committed.where(committed.next_tokens >= 0)
        if not len(committed.batch_rows):
            self.paused_rows.bound()
            return CommittedPass.nothing()
        following, hidden = self._gathered(committed, aux_hidden_states)
        req_ids = self.runner.input_batch.req_ids
        names = [req_ids[i] for i in committed.batch_rows.tolist()]
        given_up = np.array([name in self.paused_rows.given_up for name in names], dtype=bool)
        lengths, first = committed.lengths, committed.first_positions
        starts = committed.ends - lengths
        self.paused_rows.keep(following, hidden, [(names[e], int(first[e]), int(starts[e]), int(lengths[e]))
                                                  for e in (~committed.drafts & ~given_up).nonzero()[0].tolist()])
        drafting = (committed.drafts & ~given_up).nonzero()[0]
        kept = [self.paused_rows.take(names[e], int(first[e])) for e in drafting.tolist()]
        self.paused_rows.bound()
        if not drafting.size:
            return CommittedPass.nothing()
        own, first = lengths[drafting], first[drafting]
        source, back = packed_ranges(starts[drafting], own), np.zeros_like(own)
        if any(k is not None for k in kept):
            following, hidden, source, back = _kept_first(following, hidden, source, own, first, kept)
        at = torch.from_numpy(source).to(following.device)
        rows = PassRows(following[at], packed_ranges(first - back, own + back), hidden[at], own + back,
                        committed.batch_rows[drafting])
        return CommittedPass(rows, first + own, int(own.sum()))

    def _gathered(self, committed: Committed, aux_hidden_states) -> tuple[torch.Tensor, torch.Tensor]:
        """Every entry's rows at once: each row's next token and the target's
        hidden states (a copy: vLLM reuses its buffers)."""
        rows = committed.rows
        if int(rows[-1]) - int(rows[0]) + 1 == len(rows):  # no tree verified (rows rise): the batch's rows, sliced
            index = slice(int(rows[0]), int(rows[0]) + len(rows))
        else:
            index = torch.from_numpy(rows).to(self.runner.device)
        ids = self.runner.input_ids.gpu[index].to(torch.long)
        following = torch.empty_like(ids)
        following[:-1] = ids[1:]
        following[torch.from_numpy(committed.ends - 1).to(ids.device)] = torch.from_numpy(
            committed.next_tokens).to(ids.device)
        return following, torch.cat([h[index] for h in aux_hidden_states], dim=-1)

    def _combine(self, aux):
        return self.native.model.combine_hidden_states(aux)

    def _forward(self, tokens, positions, hidden):
        return self.native.model(input_ids=tokens, positions=positions, hidden_states=hidden)

    def begin(self, rows: list[int]) -> TreeScratch:
        """The base's scratch, with each request's root hidden state (the
        first pass's last row) and room for its nodes' own."""
        scratch = super().begin(rows)
        roots = self.roots
        if roots is None or roots.hidden is None:
            return scratch
        # The nodes' columns, the spill, and the root's (draft_layer): the root's hidden state in the last.
        scratch.hidden = roots.hidden.new_zeros(len(rows), self.max_nodes + 2, roots.hidden.shape[-1])
        scratch.hidden[:, -1] = roots.picked(roots.hidden, roots.index[np.asarray(rows, dtype=np.int64)],
                                             roots.hidden.device)
        return scratch

    def _target_ids(self) -> torch.Tensor | None:
        """The head's LM head covers a reduced vocabulary, whose logits vLLM
        scatters into a -inf row of the target's: passes reduce the head's
        own logits and map their top tokens (``d2t``) instead, a sixth of the
        work for 8k of 49k tokens. Read once the weights are loaded."""
        d2t = getattr(self.native.model, "draft_id_to_target_id", None)
        if d2t is not None and self._draft_vocab is None:
            self._draft_vocab = d2t.detach() + torch.arange(d2t.shape[0], device=d2t.device)
        return self._draft_vocab
