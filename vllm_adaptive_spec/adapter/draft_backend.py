"""Model drafting on vLLM: the native proposer's draft model (an EAGLE-3 head
for ``eagle3``, a small LM for ``draft_model``) run by the tree drafter, its
KV in vLLM's paged cache.

Per engine step, after verification:

Two variants over one base, :class:`PagedDraftBackend`: an EAGLE-3 head
(``adapter/draft_head.py``) and a draft LM (``adapter/draft_lm.py``).

1. :meth:`PagedDraftBackend.first_pass` runs the draft model, causally and
   through vLLM's own attention kernel, on every request's newly committed
   tokens in chain order (the accepted path, compacted), writing their draft
   KV at their final slots; so whatever a rejected branch left in the draft
   cache is overwritten before anything reads it. EAGLE-3 pairs the target's
   auxiliary hidden states of position ``p`` with token ``p + 1`` (the last
   row reads the new bonus token); a draft LM reads the tokens themselves plus
   the bonus token. The last row's distribution gives the root's children.
   While the load budget pauses drafting no pass runs; the next drafting
   step catches up (see :meth:`~PagedDraftBackend.first_pass`).
2. :meth:`feed` runs one tree layer: node rows sit at position
   ``root row + depth``, write their KV into scratch slots right after the
   committed draft context (``C + node id``), and attend, through
   ``kernels.tree_attention``, to the committed context and their ancestors.
   vLLM reserves that scratch: the adapter asks for ``draft_slots`` lookahead
   tokens, and nodes beyond a request's allocated blocks are not fed.

Every pass reduces its logits to what the policies read
(``kernels.draft_distribution``: the top ``top_k`` tokens and probabilities,
the confidence and the top-``top_m`` entropy), on the device the model runs
on; dense distributions never leave the backend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

from kernels.draft_distribution import DraftDistribution, draft_distribution
from vllm_adaptive_spec.adapter import step as tree_step
from vllm_adaptive_spec.adapter.draft_layers import PassLayout, RaggedLayers, empty_distribution
from vllm_adaptive_spec.draft_layer import TreeState, empty_state


class _Committed(NamedTuple):
    """A request's rows committed this step."""

    batch_row: int
    rows: np.ndarray  # its query rows, in chain order
    first_position: int
    next_token: int | None  # the token after them; None: nothing committed after them yet
    drafts: bool


class PassRows(NamedTuple):
    """The rows of one draft forward, an entry a request: ``tokens`` and
    ``positions`` of consecutive rows of batch row ``batch_rows[e]`` (and an
    EAGLE-3 head's ``aux``, the target's hidden states of those rows)."""

    tokens: list[torch.Tensor]
    positions: list[torch.Tensor]
    aux: list[torch.Tensor]
    batch_rows: list[int]

    def total(self) -> int:
        return sum(len(t) for t in self.tokens)

    def split(self, take: list[int]) -> tuple["PassRows", "PassRows"]:
        """The first ``take[e]`` rows of each entry (entries taking none left
        out), and the rest."""
        picked = [e for e, k in enumerate(take) if k > 0]

        def head(parts):
            return [parts[e][: take[e]] for e in picked] if parts else []

        def rest(parts):
            return [part[k:] for part, k in zip(parts, take)] if parts else []

        first = PassRows(head(self.tokens), head(self.positions), head(self.aux), [self.batch_rows[e] for e in picked])
        return first, PassRows(rest(self.tokens), rest(self.positions), rest(self.aux), self.batch_rows)


class CommittedPass(NamedTuple):
    """What a variant makes of the step's committed rows: the first pass's
    ``rows``, each drafting batch row's ``(C, root row position)`` in
    ``context`` (``C``: its committed draft context), and how many of the
    rows are this step's own (the rest catch up on paused steps)."""

    rows: PassRows
    context: dict[int, tuple[int, int]]
    own_rows: int


class StepRoots(NamedTuple):
    """What the step's first pass leaves for its trees: the roots' draft
    ``distribution`` (row ``index[batch row]``), each drafting batch row's
    ``context`` (:class:`CommittedPass`), an EAGLE-3 head's ``hidden``
    state of each root row, and the pass's ``block_table``."""

    distribution: DraftDistribution
    index: dict[int, int]
    context: dict[int, tuple[int, int]]
    hidden: torch.Tensor | None
    block_table: torch.Tensor


@dataclass
class TreeScratch:
    """One step's trees as the draft model grows them, per drafting request
    (batch rows ``rows``): the ``roots``' draft distributions, each
    request's committed draft ``context`` length ``C`` and root position,
    the trees' ``state`` (``draft_layer.TreeState``: nodes fed, room,
    depths, ancestor sets), the committed context as the attention reads
    it (``keys``), an EAGLE-3 head's hidden states (``hidden`` per node,
    its last column the spill; ``root_hidden`` per request), and the
    contexts on the host (``host_context``, ``longest_context``: the
    attention metadata's bounds).
    Its tensors are where the layer variant keeps them (``draft_layers``)."""

    roots: DraftDistribution
    rows: torch.Tensor
    context: torch.Tensor
    root_position: torch.Tensor
    state: TreeState
    block_table: torch.Tensor | None
    keys: tree_step.StepKeys | None = None
    hidden: torch.Tensor | None = None
    root_hidden: torch.Tensor | None = None
    host_context: torch.Tensor | None = None
    longest_context: int = 0


class PagedDraftBackend:
    """What both draft models share (:class:`~vllm_adaptive_spec.adapter.draft_head.HeadDraftBackend`,
    :class:`~vllm_adaptive_spec.adapter.draft_lm.LMDraftBackend`): the step's
    committed rows, the first pass, tree layers (as ``layers``, a
    ``draft_layers`` variant, runs them), the forward over vLLM's paged cache."""

    def __init__(self, runner, native, max_nodes: int, layers=None) -> None:
        self.runner = runner
        self.native = native
        self.max_nodes = max_nodes
        self.layers = RaggedLayers() if layers is None else layers
        self.max_pass_rows = native.max_num_tokens  # rows one draft forward takes (vLLM's buffers)
        self.top_k, self.top_m = 1, 0  # what each pass keeps of its distributions (set by the drafter)
        self.roots: StepRoots | None = None  # the last first pass's, for this step's trees

    @property
    def fixed_layers(self) -> bool:
        """Whether every tree layer runs at fixed capacity, reading nothing back."""
        return self.layers.fixed

    @property
    def device(self) -> torch.device:
        """Where the trees' scratch and distributions are."""
        return self.layers.device

    # -- what the variants differ in ------------------------------------------------
    def forget(self, request_ids) -> None:
        raise NotImplementedError

    def requests_held(self) -> int:
        """Requests with draft state kept between steps (0 when idle)."""
        raise NotImplementedError

    def can_draft(self, request_id: str) -> bool:
        """Whether the draft model can draft for the request."""
        return True

    def _behind(self, request_id: str, length: int) -> int:
        """Rows the request's draft state needs fed to catch up."""
        raise NotImplementedError

    def _committed_pass(self, entries: list[_Committed], aux_hidden_states) -> CommittedPass:
        raise NotImplementedError

    def _combine(self, aux: list[torch.Tensor]) -> torch.Tensor | None:
        """The first pass's hidden-state input (none for a draft LM)."""
        return None

    def _forward(self, tokens, positions, hidden):
        """The draft model on one pass: ``(normed, prenorm)`` hidden states."""
        raise NotImplementedError

    def _target_ids(self) -> torch.Tensor | None:
        """Target token ids of the draft vocabulary, where it is reduced."""
        return None

    # -- step start ---------------------------------------------------------------
    def least_behind(self, count: int) -> set[int]:
        """The ``count`` batch rows whose draft state needs the fewest rows
        fed to catch up (a probe drafts for these only)."""
        batch = self.runner.input_batch
        lengths = batch.num_tokens_no_spec
        order = sorted(range(batch.num_reqs), key=lambda i: self._behind(batch.req_ids[i], int(lengths[i])))
        return set(order[:count])

    def first_pass(self, aux_hidden_states, block_table: torch.Tensor, accepted: dict[int, list[int]],
                   sampled: list[list[int]], drafting: bool = True, only_rows: set[int] | None = None) -> float:
        """``accepted[row]``: for requests verified with a tree, the query rows
        (absolute) of their committed tokens in chain order; other requests
        committed all their scheduled rows. ``sampled``: each request's new
        tokens this step (empty for a partial prefill, whose next token is
        the next prompt token).

        ``drafting`` False (the load budget paused drafting): no distribution
        is needed and no pass runs. A draft LM remembers where its KV stops;
        an EAGLE-3 head, which can read the target's hidden states of this
        step only, keeps their rows (:class:`PausedRows`). The next drafting
        step feeds every token since (batched catch-up passes of at most
        ``max_pass_rows`` rows), so the draft KV is complete when drafting
        resumes. ``only_rows`` (a probe): the batch rows that draft; the
        others are treated as paused. The roots it leaves are :attr:`roots`.

        Returns the share of the rows fed that are this step's own (the rest
        catch up on paused steps): the load budget counts that share of the
        pass's time as the step's drafting cost, since a catch-up is paid once
        whatever is decided next."""
        self.roots = None
        committed = self._committed_pass(self._committed(accepted, sampled, drafting, only_rows), aux_hidden_states)
        rows = committed.rows
        if not rows.batch_rows:
            return 0.0
        own_share = committed.own_rows / rows.total()
        logits, out_hidden, last = self._feed_rows(self._feed_oldest(rows, block_table), block_table, drafting)
        if drafting:
            index = {i: k for k, i in enumerate(rows.batch_rows)}
            hidden = None if out_hidden is None else out_hidden[last.to(out_hidden.device)]
            self.roots = StepRoots(self.distribution(logits), index, committed.context, hidden, block_table)
        return own_share if drafting else 0.0

    def _committed(self, accepted, sampled, drafting: bool, only_rows) -> list[_Committed]:
        """Every request that committed rows this step (:class:`_Committed`)."""
        runner = self.runner
        batch = runner.input_batch
        query_start = runner.query_start_loc.np[: batch.num_reqs + 1]
        spans = []
        for i in range(batch.num_reqs):
            chain = accepted.get(i)
            rows = (np.asarray(chain, dtype=np.int64) if chain
                    else np.arange(query_start[i], query_start[i + 1], dtype=np.int64))
            if rows.size:
                spans.append((i, rows))
        if not spans:
            return []
        firsts = runner.positions[torch.tensor([rows[0] for _, rows in spans])].tolist()
        entries = []
        for (i, rows), p0 in zip(spans, firsts):
            next_position = p0 + len(rows)
            if sampled[i]:
                next_token = sampled[i][-1]
            elif next_position < int(batch.num_prompt_tokens[i]):
                next_token = int(batch.token_ids_cpu[i, next_position])
            else:
                next_token = None
            entries.append(_Committed(i, rows, p0, next_token, drafting and (only_rows is None or i in only_rows)))
        return entries

    def _feed_oldest(self, rows: PassRows, block_table) -> PassRows:
        """While a pass's rows exceed what one draft forward takes (vLLM's
        buffers hold ``max_num_batched_tokens``; a catch-up after a long pause
        holds more), feed each request's oldest rows in a pass of their own,
        keeping at least its last row for the pass that gives the roots; the
        rows left."""
        while rows.total() > self.max_pass_rows:
            room, take = self.max_pass_rows, []
            for entry in rows.tokens:
                take.append(min(len(entry) - 1, room))
                room -= take[-1]
            if not any(take):  # a row per request is more than a pass takes: vLLM schedules no such step
                return rows
            oldest, rows = rows.split(take)
            self._feed_rows(oldest, block_table, logits=False)
        return rows

    def _feed_rows(self, rows: PassRows, block_table, logits: bool):
        """One draft forward over ``rows``: the logits and hidden states of
        each entry's last row (no logits unless ``logits``), and those rows'
        indexes."""
        lens_t = torch.tensor([len(t) for t in rows.tokens], dtype=torch.int32)
        starts = torch.zeros(len(rows.tokens) + 1, dtype=torch.int32)
        starts[1:] = lens_t.cumsum(0)
        positions_t = torch.cat(rows.positions)
        rows_t = torch.tensor(rows.batch_rows, dtype=torch.long)
        slots = self.slots(block_table, torch.repeat_interleave(rows_t, lens_t.long()), positions_t)
        last = starts[1:].long() - 1
        seq_lens = (positions_t[last] + 1).to(torch.int32)  # each entry's last position, one gather
        layout = PassLayout.on_host(starts, seq_lens, block_table[rows_t])
        out_logits, out_hidden = self.run(torch.cat(rows.tokens), positions_t, self._combine(rows.aux), slots, layout,
                                          logit_rows=last if logits else last[:0])
        return out_logits, out_hidden, last

    # -- tree growth ----------------------------------------------------------------
    def begin(self, rows: list[int]) -> TreeScratch:
        """Start one tree per drafting request (batch rows): the roots' draft
        distributions, ``[B, top_k]`` (zero probabilities where a request has
        none), and the scratch its layers grow."""
        roots = self.roots
        context = {} if roots is None else roots.context
        block_size = self.runner.input_batch.block_table[0].block_size
        allocated = self.runner.input_batch.block_table[0].num_blocks_per_row
        batch = len(rows)
        committed = torch.tensor([context.get(i, (0, 0))[0] for i in rows], dtype=torch.long)
        ready = torch.tensor([i in context for i in rows], dtype=torch.bool)
        room = torch.from_numpy(np.asarray(allocated[rows], dtype=np.int64)) * block_size - committed
        distribution = empty_distribution((batch,), self.top_k)
        found = [] if roots is None else [(b, roots.index[i]) for b, i in enumerate(rows) if i in roots.index]
        if found:
            at, source = (torch.tensor(x, dtype=torch.long) for x in zip(*found))
            for mine, theirs in zip(distribution, roots.distribution):
                mine[at] = theirs[source.to(theirs.device)].to(mine.device)
        rows_t = torch.tensor(rows, dtype=torch.long)
        device = self.device
        longest = max((context[i][0] for i in rows if i in context), default=0)
        return TreeScratch(
            roots=DraftDistribution(*(x.to(device) for x in distribution)),
            rows=rows_t.to(device),
            context=committed.to(device),
            root_position=torch.tensor([context.get(i, (0, 0))[1] for i in rows], dtype=torch.long, device=device),
            state=empty_state(torch.where(ready, room.clamp(0, self.max_nodes), 0).to(device), self.max_nodes),
            block_table=None if roots is None else roots.block_table,
            keys=None if roots is None else tree_step.StepKeys(committed, roots.block_table[rows_t]),
            host_context=committed,
            longest_context=longest,
        )

    def feed(self, scratch: TreeScratch, live: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
        """Run the draft model on the live frontier nodes ``[B, F]``; their
        node ids (-1: not fed) and draft distributions, ``[B, F, top_k]``,
        as the backend's layer variant (``draft_layers``) runs them."""
        return self.layers.feed(self, scratch, live, tokens, parents)

    # -- one forward of the draft model ----------------------------------------------
    def slots(self, block_table: torch.Tensor, batch_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        block_size = self.runner.input_batch.block_table[0].block_size
        batch_rows, positions = batch_rows.to(block_table.device), positions.to(block_table.device)
        blocks = block_table[batch_rows, positions // block_size].to(torch.long)
        return blocks * block_size + positions % block_size

    def run(self, tokens, positions, hidden, slots, layout: PassLayout, logit_rows=None):
        """One draft-model forward over the rows of ``layout``; the logits of
        ``logit_rows`` only (all rows when None: the LM head is a large part
        of a small draft model's cost), over the head's own vocabulary where
        it has one."""
        native = self.native
        num_tokens = int(tokens.shape[0])
        device = self.runner.device
        tokens, positions, slots = tokens.to(device), positions.to(device), slots.to(device)
        hidden = None if hidden is None else hidden.to(device)
        metadata = CommonAttentionMetadata(
            query_start_loc=layout.query_start_loc.to(device),
            query_start_loc_cpu=layout.query_start_loc,
            seq_lens=layout.seq_lens.to(device),
            seq_lens_cpu_upper_bound=layout.seq_lens_bound,
            num_reqs=int(layout.seq_lens.shape[0]),
            num_actual_tokens=num_tokens,
            max_query_len=layout.max_query_len,
            max_seq_len=layout.max_seq_len,
            block_table_tensor=layout.block_table.to(device),
            slot_mapping=slots,
            positions=positions,
        )
        _, per_layer = native.build_per_group_and_layer_attn_metadata(metadata)
        with set_forward_context(
            per_layer, native.vllm_config, num_tokens=num_tokens, slot_mapping=native._get_slot_mapping(num_tokens, slots)
        ):
            normed, prenorm = self._forward(tokens, positions, hidden)
        if logit_rows is not None:
            normed = normed[logit_rows.to(device)]
        if self._target_ids() is not None:
            return native.model.logits_processor(native.model.lm_head, normed), prenorm
        return native.model.compute_logits(normed), prenorm

    def distribution(self, logits: torch.Tensor) -> DraftDistribution:
        """The pass's distributions, tokens in the target's vocabulary (ties:
        the lower draft id first, the target's order where ``d2t`` ascends)."""
        dist = draft_distribution(logits, self.top_k, self.top_m)
        target_ids = self._target_ids()
        return dist if target_ids is None else dist._replace(tokens=target_ids[dist.tokens])

