"""A small draft LM as the tree drafter's draft model (``draft_model``).

Its first pass reads the committed tokens themselves plus the token after
them; a paused LM remembers where its draft KV stops, and the next drafting
step feeds every token since from the request's token history.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaptive_spec.adapter.draft_backend import CommittedPass, PagedDraftBackend, PassRows


class LMDraftBackend(PagedDraftBackend):
    def __init__(self, runner, native, max_nodes: int, layers=None) -> None:
        super().__init__(runner, native, max_nodes, layers)
        self._stops: dict[str, int] = {}  # paused request -> first position without draft KV

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._stops.pop(request_id, None)

    def requests_held(self) -> int:
        """Paused requests, whose draft KV stops before their tokens."""
        return len(self._stops)

    def _behind(self, request_id: str, length: int) -> int:
        return length - self._stops.get(request_id, length)

    def _committed_pass(self, entries, aux_hidden_states) -> CommittedPass:
        """Each drafting request's tokens since its draft KV stops (paused
        steps' tokens first), its committed rows and the token after them; a
        paused request remembers where its KV stops."""
        batch = self.runner.input_batch
        input_ids = self.runner.input_ids.gpu
        rows, context, own = PassRows([], [], [], []), {}, 0
        for i, committed, p0, next_token, drafts in entries:
            if not drafts:
                self._stops.setdefault(batch.req_ids[i], p0)
                continue
            if next_token is None:
                continue
            m = len(committed)
            ids = input_ids[torch.from_numpy(committed).to(input_ids.device)].to(torch.long)
            start = min(self._stops.pop(batch.req_ids[i], p0), p0)
            missed = torch.from_numpy(batch.token_ids_cpu[i, start:p0].astype(np.int64)).to(ids.device)
            rows.tokens.append(torch.cat([missed, ids, ids.new_tensor([next_token])]))
            rows.positions.append(torch.arange(start, p0 + m + 1))
            rows.batch_rows.append(i)
            context[i] = (p0 + m + 1, p0 + m)
            own += m + 1
        return CommittedPass(rows, context, own)

    def _forward(self, tokens, positions, hidden):
        return self.native.model(input_ids=tokens, positions=positions), None
