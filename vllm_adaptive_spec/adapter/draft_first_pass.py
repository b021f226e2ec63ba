"""A step's one first pass of a model drafter (``PagedDraftBackend.first_pass``),
run when the step knows which rows draft.

Usually that is before the trees are proposed: every row drafts, a probe's
few rows, or none on a paused step. On a paused step of a drafter that fills
(the hybrid: the head's tree where its trie has none, see
``TreeProposer.propose_trees``), the rows are known only once the trie has
drafted, so the proposer runs it through :meth:`StepFirstPass.fill`; a
step whose fill drafted nothing runs it paused in :meth:`finish`.
"""

from __future__ import annotations

import time

from vllm_adaptive_spec.step.propose import FirstPass


class StepFirstPass:
    """``backend``: the model drafter's backend; the rest, what its first pass reads."""

    def __init__(self, backend, aux_hidden_states, block_table, accepted_rows, sampled_token_ids, req_ids) -> None:
        self.backend, self.req_ids = backend, req_ids
        self._inputs = (aux_hidden_states, block_table, accepted_rows, sampled_token_ids)
        self.runs: list[FirstPass] = []

    @property
    def seconds(self) -> float:
        """The drafting seconds the step was charged for its pass (0 before one ran)."""
        return self.runs[0].seconds if self.runs else 0.0

    def now(self, drafting: bool, probe: int | None) -> set[int] | None:
        """Run the pass before the trees: for every row when ``drafting``,
        for the ``probe`` rows least behind (returned), or paused."""
        rows = None if probe is None or not drafting else self.backend.least_behind(probe)
        self._run(drafting, rows)
        return rows

    def fill(self, rows: set[int]) -> FirstPass:
        """The pass for the rows a fill drafts (those the backend can draft
        for), the others paused. The fill is charged the whole pass, catch-up
        included: the rows the trie's steps left behind are fed because it
        drafts, and again after every trie run."""
        return self._run(True, {i for i in rows if self.backend.can_draft(self.req_ids[i])}, catch_up_charged=True)

    def finish(self) -> None:
        """A step whose pass has not run yet (no fill drafted) runs it paused."""
        if not self.runs:
            self._run(False, None)

    def _run(self, drafting: bool, rows: set[int] | None, catch_up_charged: bool = False) -> FirstPass:
        started = time.perf_counter()
        own_share = self.backend.first_pass(*self._inputs, drafting, rows)
        share = 1.0 if catch_up_charged else own_share
        self.runs.append(FirstPass(set(range(len(self.req_ids))) if rows is None else rows,
                                  share * (time.perf_counter() - started)))
        return self.runs[-1]
