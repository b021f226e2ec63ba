"""A small draft LM as the tree drafter's draft model (``draft_model``).

Its first pass reads the committed tokens themselves plus the token after
them; a paused LM remembers where its draft KV stops, and the next drafting
step feeds every token since from the request's token history.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaptive_spec.adapter.draft_backend import Committed, CommittedPass, PagedDraftBackend, PassRows
from vllm_adaptive_spec.trees.packed_ranges import packed_ranges


class LMDraftBackend(PagedDraftBackend):
    ROWS_AFTER_CHAIN = 1  # the token after the chain

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

    def _committed_pass(self, committed: Committed, aux_hidden_states) -> CommittedPass:
        """Each drafting request's tokens since its draft KV stops (paused
        steps' tokens first, from the request's token history), its
        committed rows and the token after them, packed in two writes: the
        committed rows' tokens where the step's are, the rest from the
        host. A paused request remembers where its KV stops."""
        batch = self.runner.input_batch
        for i, p0 in zip(committed.batch_rows[~committed.drafts].tolist(),
                         committed.first_positions[~committed.drafts].tolist()):
            self._stops.setdefault(batch.req_ids[i], p0)
        committed = committed.where(committed.drafts & (committed.next_tokens >= 0))
        if not len(committed.batch_rows):
            return CommittedPass.nothing()
        first, own = committed.first_positions, committed.lengths + 1  # the rows and the token after them
        start = np.array([min(self._stops.pop(batch.req_ids[i], p0), p0)
                          for i, p0 in zip(committed.batch_rows.tolist(), first.tolist())], dtype=np.int64)
        missed, total = first - start, first - start + own
        offsets = np.cumsum(total) - total
        input_ids = self.runner.input_ids.gpu
        device = input_ids.device
        tokens = torch.empty(int(total.sum()), dtype=torch.long, device=device)
        tokens[torch.from_numpy(packed_ranges(offsets + missed, own - 1)).to(device)] = (
            input_ids[torch.from_numpy(committed.rows).to(device)].to(torch.long))
        history = batch.token_ids_cpu[np.repeat(committed.batch_rows, missed), packed_ranges(start, missed)]
        host_at = np.concatenate([packed_ranges(offsets, missed), offsets + total - 1])
        host_tokens = np.concatenate([history.astype(np.int64), committed.next_tokens])
        tokens[torch.from_numpy(host_at).to(device)] = torch.from_numpy(host_tokens).to(device)
        rows = PassRows(tokens, packed_ranges(start, total), None, total, committed.batch_rows)
        return CommittedPass(rows, first + own, int(own.sum()))

    def _forward(self, tokens, positions, hidden):
        return self.native.model(input_ids=tokens, positions=positions), None
