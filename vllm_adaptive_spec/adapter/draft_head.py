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

from vllm_adaptive_spec.adapter.draft_backend import CommittedPass, PagedDraftBackend, PassRows, TreeScratch
from vllm_adaptive_spec.paused_rows import PausedRows


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

    def _committed_pass(self, entries, aux_hidden_states) -> CommittedPass:
        """The step's rows of every request, gathered for the whole batch at
        once: each row's input token (the next one; the last row's is the
        token after the chain) and the target's auxiliary hidden states.
        Paused requests' rows are kept as one block (:meth:`PausedRows.keep`:
        a paused step costs these gathers, not an operation per request);
        drafting ones go into the pass, after the rows they kept."""
        entries = [e for e in entries if e.next_token is not None]
        rows = PassRows([], [], [], [])
        if not entries:
            self.paused_rows.bound()
            return CommittedPass(rows, {}, 0)
        following, hidden, ends = self._gathered(entries, aux_hidden_states)
        context, own, paused = {}, 0, []
        req_ids = self.runner.input_batch.req_ids
        for (i, committed, p0, _, drafts), end in zip(entries, ends.tolist()):
            request_id, m = req_ids[i], len(committed)
            if request_id in self.paused_rows.given_up:
                continue
            if not drafts:
                paused.append((request_id, p0, end - m, m))
                continue
            step_tokens, step_hidden = following[end - m:end], hidden[end - m:end]
            start, kept = p0, self.paused_rows.take(request_id, p0)
            if kept is not None:
                start, kept_tokens, kept_hidden = kept
                step_tokens, step_hidden = torch.cat([*kept_tokens, step_tokens]), torch.cat([*kept_hidden, step_hidden])
            rows.tokens.append(step_tokens)
            rows.positions.append(torch.arange(start, p0 + m))
            rows.aux.append(step_hidden)
            rows.batch_rows.append(i)
            context[i] = (p0 + m, p0 + m - 1)
            own += m
        self.paused_rows.keep(following, hidden, paused)
        self.paused_rows.bound()
        return CommittedPass(rows, context, own)

    def _gathered(self, entries, aux_hidden_states) -> tuple[torch.Tensor, torch.Tensor, np.ndarray]:
        """Every entry's rows at once: each row's next token, the target's
        hidden states (a copy: vLLM reuses its buffers), and each entry's end."""
        ends = np.cumsum([len(e.rows) for e in entries])
        rows = np.concatenate([e.rows for e in entries])
        if (np.diff(rows) == 1).all():  # no tree verified: the batch's rows in order, sliced
            index = slice(int(rows[0]), int(rows[0]) + len(rows))
        else:
            index = torch.from_numpy(rows).to(self.runner.device)
        ids = self.runner.input_ids.gpu[index].to(torch.long)
        following = torch.empty_like(ids)
        following[:-1] = ids[1:]
        following[torch.from_numpy(ends - 1).to(ids.device)] = torch.tensor([e.next_token for e in entries],
                                                                             dtype=torch.long, device=ids.device)
        return following, torch.cat([h[index] for h in aux_hidden_states], dim=-1), ends

    def _combine(self, aux):
        return self.native.model.combine_hidden_states(torch.cat(aux))

    def _forward(self, tokens, positions, hidden):
        return self.native.model(input_ids=tokens, positions=positions, hidden_states=hidden)

    def begin(self, rows: list[int]) -> TreeScratch:
        """The base's scratch, with each request's root hidden state (the
        first pass's last row) and room for its nodes' own."""
        scratch = super().begin(rows)
        roots = self.roots
        if roots is None or roots.hidden is None:
            return scratch
        found = [(b, roots.index[i]) for b, i in enumerate(rows) if i in roots.index]
        width = roots.hidden.shape[-1]
        scratch.root_hidden = roots.hidden.new_zeros(len(rows), width)
        if found:
            at, source = (torch.tensor(x, dtype=torch.long, device=roots.hidden.device) for x in zip(*found))
            scratch.root_hidden[at] = roots.hidden[source]
        scratch.hidden = roots.hidden.new_zeros(len(rows), self.max_nodes + 1, width)  # the last: the spill
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
