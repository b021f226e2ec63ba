"""Model drafting on vLLM: the native proposer's draft model (an EAGLE-3 head
for ``eagle3``, a small LM for ``draft_model``) run by the tree drafter, its
KV in vLLM's paged cache.

Per engine step, after verification:

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

from typing import NamedTuple

import numpy as np
import torch
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

from kernels.draft_distribution import DraftDistribution, draft_distribution
from vllm_adaptive_spec.adapter import step as tree_step
from vllm_adaptive_spec.paused_rows import PausedRows


class _Committed(NamedTuple):
    """A request's rows committed this step."""

    batch_row: int
    rows: np.ndarray  # its query rows, in chain order
    first_position: int
    next_token: int | None  # the token after them; None: nothing committed after them yet
    drafts: bool


class PagedDraftBackend:
    # Bytes of paused steps' rows kept for EAGLE-3 (all requests; see
    # paused_rows.py): 9,700 rows of the demo model (float32, three 576-wide
    # hidden states), 2,700 of an 8B model in bf16. Beyond it the requests
    # keeping the most rows give theirs up (until half of it is left), and
    # with them the head's drafts for the rest of their lives. Decision: not
    # fed instead. A head paused that long is one that does not pay, and
    # feeding the rows anyway would run it over every prompt the server
    # receives (under load on the CPU, a tenth of the server's time); a request
    # that finishes while paused is never fed: its rows cost only their gather.
    STASH_BYTES = 64 << 20

    def __init__(self, runner, native, max_nodes: int) -> None:
        self.runner = runner
        self.native = native
        self.is_eagle3 = native.method == "eagle3"
        self._draft_vocab: torch.Tensor | None = None  # see _target_ids
        self.max_nodes = max_nodes
        self.max_pass_rows = native.max_num_tokens  # rows one draft forward takes (vLLM's buffers)
        self.top_k, self.top_m = 1, 0  # what each pass keeps of its distributions (set by the drafter)
        self._roots: DraftDistribution | None = None
        self._root_index: dict[int, int] = {}  # batch row -> row of _roots
        self._root_hidden: dict[int, torch.Tensor] = {}
        self._context: dict[int, tuple[int, int]] = {}  # batch row -> (C, root row position)
        self._behind: dict[str, int] = {}  # draft LM: request -> first position without draft KV
        self.paused_rows = PausedRows(self.STASH_BYTES)  # EAGLE-3: rows of paused steps, not yet fed

    def forget(self, request_ids) -> None:
        for request_id in request_ids:
            self._behind.pop(request_id, None)
        self.paused_rows.drop(request_ids)

    def requests_held(self) -> int:
        """Requests with draft state between steps: where a paused draft LM's
        KV stops, an EAGLE-3 head's kept rows, or that it gave them up."""
        return len(self._behind) + self.paused_rows.requests_held()

    def can_draft(self, request_id: str) -> bool:
        """Whether the draft model can draft for the request (False once an
        EAGLE-3 head gave up its kept rows: its draft KV would have a hole)."""
        return request_id not in self.paused_rows.given_up

    def least_behind(self, count: int) -> set[int]:
        """The ``count`` batch rows whose draft state needs the fewest rows
        fed to catch up (a probe drafts for these only)."""
        batch = self.runner.input_batch
        lengths = batch.num_tokens_no_spec

        def behind(i: int) -> int:
            request_id = batch.req_ids[i]
            if self.is_eagle3:
                if request_id in self.paused_rows.given_up:
                    return 1 << 62
                return self.paused_rows.rows(request_id)
            return int(lengths[i]) - self._behind.get(request_id, int(lengths[i]))

        return set(sorted(range(batch.num_reqs), key=behind)[:count])

    # -- step start ---------------------------------------------------------------
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
        resumes; beyond ``STASH_BYTES`` of kept rows the largest are
        dropped and their requests never drafted by the head again
        (:meth:`can_draft`). ``only_rows`` (a probe): the batch rows that
        draft; the others are treated as paused.

        Returns the share of the rows fed that are this step's own (the rest
        catch up on paused steps): the load budget counts that share of the
        pass's time as the step's drafting cost, since a catch-up is paid once
        whatever is decided next."""
        self._roots = None
        self._root_index.clear()
        self._root_hidden.clear()
        self._context.clear()

        tokens, pos, aux, batch_rows = [], [], [], []
        entries = self._committed(accepted, sampled, drafting, only_rows)
        if self.is_eagle3:
            own_rows = self._head_entries(entries, aux_hidden_states, tokens, pos, aux, batch_rows)
        else:
            own_rows = self._lm_entries(entries, tokens, pos, batch_rows)
        if self.is_eagle3:
            self.paused_rows.bound()
        if not batch_rows:
            return 0.0
        own_share = own_rows / sum(len(t) for t in tokens)
        self._feed_oldest(tokens, pos, aux, batch_rows, block_table)
        logits, out_hidden, last = self._feed_rows(tokens, pos, aux, batch_rows, block_table, drafting)
        if not drafting:
            self._context.clear()
            return 0.0
        self._roots = self._distribution(logits)
        for k, i in enumerate(batch_rows):
            self._root_index[i] = k
            if out_hidden is not None:
                self._root_hidden[i] = out_hidden[last[k]]
        self._block_table = block_table
        return own_share

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

    def _head_entries(self, entries, aux_hidden_states, tokens, pos, aux, batch_rows) -> int:
        """EAGLE-3: the step's rows of every request, gathered for the whole
        batch at once: each row's input token (the next one; the last row's
        is the token after the chain) and the target's auxiliary hidden
        states. Paused requests' rows are kept as one block
        (:meth:`PausedRows.keep`: a paused step costs these gathers, not an
        operation per request); drafting ones are appended to the pass, after
        the rows they kept. Returns the rows that are this step's own."""
        entries = [e for e in entries if e.next_token is not None]
        if not entries:
            return 0
        lengths = [len(e.rows) for e in entries]
        ends = np.cumsum(lengths)
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
        hidden = torch.cat([h[index] for h in aux_hidden_states], dim=-1)  # a copy: vLLM reuses its buffers
        own = 0
        paused = []
        req_ids = self.runner.input_batch.req_ids
        given_up = self.paused_rows.given_up
        for (i, _, p0, _, drafts), end, m in zip(entries, ends.tolist(), lengths):
            request_id = req_ids[i]
            if request_id in given_up:
                continue
            if not drafts:
                paused.append((request_id, p0, end - m, m))
                continue
            step_tokens, step_hidden = following[end - m:end], hidden[end - m:end]
            kept = self.paused_rows.take(request_id, p0)
            if kept is None:
                start = p0
            else:
                start, kept_tokens, kept_hidden = kept
                step_tokens, step_hidden = torch.cat([*kept_tokens, step_tokens]), torch.cat([*kept_hidden, step_hidden])
            tokens.append(step_tokens)
            pos.append(torch.arange(start, p0 + m))
            aux.append(step_hidden)
            self._context[i] = (p0 + m, p0 + m - 1)
            own += m
            batch_rows.append(i)
        self.paused_rows.keep(following, hidden, paused)
        return own

    def _lm_entries(self, entries, tokens, pos, batch_rows) -> int:
        """Draft LM: each drafting request's tokens since its draft KV stops
        (paused steps' tokens first), its committed rows and the token after
        them; a paused request remembers where its KV stops. Returns the rows
        that are this step's own."""
        batch = self.runner.input_batch
        input_ids = self.runner.input_ids.gpu
        own = 0
        for i, rows, p0, next_token, drafts in entries:
            if not drafts:
                self._behind.setdefault(batch.req_ids[i], p0)
                continue
            if next_token is None:
                continue
            m = len(rows)
            ids = input_ids[torch.from_numpy(rows).to(input_ids.device)].to(torch.long)
            start = min(self._behind.pop(batch.req_ids[i], p0), p0)
            missed = torch.from_numpy(batch.token_ids_cpu[i, start:p0].astype(np.int64)).to(ids.device)
            tokens.append(torch.cat([missed, ids, ids.new_tensor([next_token])]))
            pos.append(torch.arange(start, p0 + m + 1))
            self._context[i] = (p0 + m + 1, p0 + m)
            own += m + 1
            batch_rows.append(i)
        return own

    def _feed_oldest(self, tokens, pos, aux, batch_rows, block_table) -> None:
        """While a pass's rows exceed what one draft forward takes (vLLM's
        buffers hold ``max_num_batched_tokens``; a catch-up after a long pause
        holds more), feed each request's oldest rows in a pass of their own,
        keeping at least its last row for the pass that gives the roots."""
        while sum(len(t) for t in tokens) > self.max_pass_rows:
            room, take = self.max_pass_rows, []
            for entry in tokens:
                take.append(min(len(entry) - 1, room))
                room -= take[-1]
            picked = [e for e, k in enumerate(take) if k > 0]
            if not picked:  # a row per request is more than a pass takes: vLLM schedules no such step
                return
            self._feed_rows([tokens[e][: take[e]] for e in picked], [pos[e][: take[e]] for e in picked],
                            [aux[e][: take[e]] for e in picked] if aux else [], [batch_rows[e] for e in picked],
                            block_table, logits=False)
            for e in picked:
                tokens[e], pos[e] = tokens[e][take[e]:], pos[e][take[e]:]
                if aux:
                    aux[e] = aux[e][take[e]:]

    def _feed_rows(self, tokens, pos, aux, batch_rows, block_table, logits: bool):
        """One draft forward over entries of consecutive rows (a request
        each, ``batch_rows``; ``aux``: EAGLE-3's hidden states): the logits
        and hidden states of each entry's last row (no logits unless
        ``logits``), and those rows' indexes."""
        lens_t = torch.tensor([len(t) for t in tokens], dtype=torch.int32)
        starts = torch.zeros(len(tokens) + 1, dtype=torch.int32)
        starts[1:] = lens_t.cumsum(0)
        positions_t = torch.cat(pos)
        rows_t = torch.tensor(batch_rows, dtype=torch.long)
        slots = self._slots(block_table, torch.repeat_interleave(rows_t, lens_t.long()), positions_t)
        seq_lens = (torch.stack([p[-1] for p in pos]) + 1).to(torch.int32)
        hidden = self.native.model.combine_hidden_states(torch.cat(aux)) if self.is_eagle3 else None
        last = starts[1:].long() - 1
        out_logits, out_hidden = self._run(torch.cat(tokens), positions_t, hidden, slots, starts, seq_lens,
                                           block_table[rows_t], logit_rows=last if logits else last[:0])
        return out_logits, out_hidden, last

    # -- tree growth ----------------------------------------------------------------
    def begin(self, rows: list[int]) -> DraftDistribution:
        """Start one tree per drafting request (batch rows); the roots' draft
        distributions, ``[B, top_k]`` (zero probabilities where a request has none)."""
        runner = self.runner
        block_size = runner.input_batch.block_table[0].block_size
        allocated = runner.input_batch.block_table[0].num_blocks_per_row
        batch = len(rows)
        self.rows = torch.tensor(rows, dtype=torch.long)
        self.context = torch.tensor([self._context.get(i, (0, 0))[0] for i in rows], dtype=torch.long)
        self.root_position = torch.tensor([self._context.get(i, (0, 0))[1] for i in rows], dtype=torch.long)
        ready = torch.tensor([i in self._context for i in rows], dtype=torch.bool)
        room = torch.from_numpy(np.asarray(allocated[rows], dtype=np.int64)) * block_size - self.context
        self.capacity = torch.where(ready, room.clamp(0, self.max_nodes), 0)
        self.count = torch.zeros(batch, dtype=torch.long)
        self.depth = torch.zeros(batch, self.max_nodes, dtype=torch.long)
        self.ancestors = torch.zeros(batch, self.max_nodes, self.max_nodes, dtype=torch.bool)
        self.hidden = None
        roots = _empty_distribution((batch,), self.top_k)
        found = [(b, self._root_index[i]) for b, i in enumerate(rows) if i in self._root_index]
        if found:
            at, source = (torch.tensor(x, dtype=torch.long) for x in zip(*found))
            for mine, theirs in zip(roots, self._roots):
                mine[at] = theirs[source.to(theirs.device)].to(mine.device)
        if self.is_eagle3 and self._root_hidden:
            width = next(iter(self._root_hidden.values())).shape[-1]
            dtype = next(iter(self._root_hidden.values())).dtype
            device = self.runner.device
            self.root_hidden = torch.zeros(batch, width, dtype=dtype, device=device)
            for b, i in enumerate(rows):
                if i in self._root_hidden:
                    self.root_hidden[b] = self._root_hidden[i]
            self.hidden = torch.zeros(batch, self.max_nodes, width, dtype=dtype, device=device)
        return roots

    def feed(self, live: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
        """Run the draft model on the live frontier nodes; their node ids
        (-1: not fed) and draft distributions, ``[B, F, top_k]``."""
        rank = live.long().cumsum(1) - 1
        ids = self.count.unsqueeze(1) + rank
        fed = live & (ids < self.capacity.unsqueeze(1))
        ids = torch.where(fed, ids, -1)
        self.count += fed.sum(1)
        b_idx, f_idx = fed.nonzero(as_tuple=True)
        out = _empty_distribution(live.shape, self.top_k)
        if b_idx.numel() == 0:
            return ids, out
        node = ids[b_idx, f_idx]
        parent = parents[b_idx, f_idx]
        has_parent = parent >= 0
        safe_parent = parent.clamp(min=0)
        depth = torch.where(has_parent, self.depth[b_idx, safe_parent] + 1, 1)
        self.depth[b_idx, node] = depth
        lineage = self.ancestors[b_idx, safe_parent] & has_parent.unsqueeze(1)
        lineage[torch.arange(node.shape[0]), node] = True
        self.ancestors[b_idx, node] = lineage

        requests = fed.any(1).nonzero(as_tuple=True)[0]
        per_request = fed.sum(1)[requests].to(torch.int32)
        starts = torch.zeros(requests.shape[0] + 1, dtype=torch.int32)
        starts[1:] = per_request.cumsum(0)
        window = self.count[requests]
        positions = self.root_position[b_idx] + depth
        slots = self._slots(self._block_table, self.rows[b_idx], self.context[b_idx] + node)
        seq_lens = (self.context[requests] + window).to(torch.int32)
        hidden = None
        if self.is_eagle3:
            on_device = has_parent.unsqueeze(1).to(self.hidden.device)
            hidden = torch.where(on_device, self.hidden[b_idx, safe_parent], self.root_hidden[b_idx])
        mask = self.ancestors[b_idx, node, : int(window.max())]
        # A layer of one node per request that sees its whole tree (a chain) is
        # plain causal decoding: vLLM's own kernel serves it.
        request_of_row = torch.repeat_interleave(torch.arange(requests.shape[0]), per_request.long())
        causal = bool((per_request == 1).all()) and bool((mask.sum(1) == window[request_of_row]).all())
        step = None
        if not causal:
            device = self.runner.device
            step = tree_step.DraftStep(
                batch_indices=torch.arange(requests.shape[0], device=device),
                query_rows=torch.arange(node.shape[0], device=device),
                query_start_loc=starts.to(device),
                query_mask=mask.to(device),
                window_lens=window.to(device, torch.int32),
                max_query_len=int(per_request.max()),
            )
        with tree_step.published(step):
            logits, out_hidden = self._run(
                tokens[b_idx, f_idx], positions, hidden, slots, starts, seq_lens, self._block_table[self.rows[requests]]
            )
        if out_hidden is not None:
            self.hidden[b_idx, node] = out_hidden
        for mine, theirs in zip(out, self._distribution(logits)):
            mine[b_idx, f_idx] = theirs.to(mine.device)
        return ids, out

    # -- one forward of the draft model ----------------------------------------------
    def _slots(self, block_table: torch.Tensor, batch_rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        block_size = self.runner.input_batch.block_table[0].block_size
        batch_rows, positions = batch_rows.to(block_table.device), positions.to(block_table.device)
        blocks = block_table[batch_rows, positions // block_size].to(torch.long)
        return blocks * block_size + positions % block_size

    def _run(self, tokens, positions, hidden, slots, starts, seq_lens, block_table, logit_rows=None):
        """One draft-model forward; the logits of ``logit_rows`` only (all rows
        when None: the LM head is a large part of a small draft model's cost),
        over the head's own vocabulary where it has one."""
        native = self.native
        num_tokens = int(tokens.shape[0])
        # The pass's layout is built on the host; the model reads it on its device.
        device = self.runner.device
        tokens, positions, slots = tokens.to(device), positions.to(device), slots.to(device)
        hidden = None if hidden is None else hidden.to(device)
        metadata = CommonAttentionMetadata(
            query_start_loc=starts.to(device),
            query_start_loc_cpu=starts,
            seq_lens=seq_lens.to(device),
            seq_lens_cpu_upper_bound=seq_lens,
            num_reqs=int(seq_lens.shape[0]),
            num_actual_tokens=num_tokens,
            max_query_len=int(starts.diff().max()),
            max_seq_len=int(seq_lens.max()),
            block_table_tensor=block_table.to(device),
            slot_mapping=slots,
            positions=positions,
        )
        _, per_layer = native.build_per_group_and_layer_attn_metadata(metadata)
        with set_forward_context(
            per_layer, native.vllm_config, num_tokens=num_tokens, slot_mapping=native._get_slot_mapping(num_tokens, slots)
        ):
            if self.is_eagle3:
                normed, prenorm = native.model(input_ids=tokens, positions=positions, hidden_states=hidden)
            else:
                normed, prenorm = native.model(input_ids=tokens, positions=positions), None
        if logit_rows is not None:
            normed = normed[logit_rows.to(device)]
        if self._target_ids() is not None:
            return native.model.logits_processor(native.model.lm_head, normed), prenorm
        return native.model.compute_logits(normed), prenorm

    def _target_ids(self) -> torch.Tensor | None:
        """An EAGLE-3 head's LM head covers a reduced vocabulary, whose logits
        vLLM scatters into a -inf row of the target's: passes reduce the
        head's own logits and map their top tokens (``d2t``) instead, a sixth
        of the work for 8k of 49k tokens. Read once the weights are loaded."""
        d2t = getattr(self.native.model, "draft_id_to_target_id", None) if self.is_eagle3 else None
        if d2t is not None and self._draft_vocab is None:
            self._draft_vocab = d2t.detach() + torch.arange(d2t.shape[0], device=d2t.device)
        return self._draft_vocab

    def _distribution(self, logits: torch.Tensor) -> DraftDistribution:
        """The pass's distributions, tokens in the target's vocabulary (ties:
        the lower draft id first, the target's order where ``d2t`` ascends)."""
        dist = draft_distribution(logits, self.top_k, self.top_m)
        target_ids = self._target_ids()
        return dist if target_ids is None else dist._replace(tokens=target_ids[dist.tokens])


def _empty_distribution(shape: tuple[int, ...], top_k: int) -> DraftDistribution:
    """Zero probabilities (no candidates) for ``shape`` nodes."""
    return DraftDistribution(
        torch.zeros(*shape, top_k, dtype=torch.long), torch.zeros(*shape, top_k), torch.zeros(shape), torch.zeros(shape)
    )
