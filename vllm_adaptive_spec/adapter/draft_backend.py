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
   Where the tree layers run at fixed capacity, a steady step's pass is laid
   out ``[requests, width]`` instead, each request's rows then padding
   (:meth:`PagedDraftBackend._padded_width`): the shape a graph replays.
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

import itertools
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import set_forward_context
from vllm.v1.attention.backend import CommonAttentionMetadata

from kernels.draft_distribution import DraftDistribution, draft_distribution
from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.step.draft_layers import FixedShape, PassLayout, RaggedLayers, empty_distribution
from vllm_adaptive_spec.trees.layer_layout import TreeState, empty_state, node_slots
from vllm_adaptive_spec.trees.packed_ranges import packed_ranges


class Committed(NamedTuple):
    """Every request that committed rows this step, an entry each, as host
    arrays: its ``batch_rows``; its query ``rows`` in chain order, packed
    (entry ``e``'s end at ``ends[e]``); the ``first_positions`` of those
    rows; the ``next_tokens`` after them (-1: nothing committed after them
    yet); whether it ``drafts``."""

    batch_rows: np.ndarray
    rows: np.ndarray
    ends: np.ndarray
    first_positions: np.ndarray
    next_tokens: np.ndarray
    drafts: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        lengths = self.ends.copy()  # not np.diff(prepend=0): its Python-level work costs more than the rows
        lengths[1:] -= self.ends[:-1]
        return lengths

    def where(self, keep: np.ndarray) -> "Committed":
        """The entries ``keep`` (a mask), with their rows."""
        if keep.all():  # every step but those with a prompt chunk: nothing to drop
            return self
        lengths = self.lengths
        return Committed(self.batch_rows[keep], self.rows[np.repeat(keep, lengths)], np.cumsum(lengths[keep]),
                         self.first_positions[keep], self.next_tokens[keep], self.drafts[keep])


class PassRows(NamedTuple):
    """The rows of one draft forward, packed entry after entry (an entry a
    request): ``tokens`` ``[T]`` and an EAGLE-3 head's ``aux`` (the target's
    hidden states of those rows, ``[T, H]``; None for a draft LM) where the
    model runs, ``positions`` ``[T]`` on the host, and each entry's row
    count (``lengths``) and ``batch_rows``. A padded pass (:meth:`padded`)
    also says how many of each entry's rows are its own (``filled``; the
    rest are padding)."""

    tokens: torch.Tensor
    positions: np.ndarray
    aux: torch.Tensor | None
    lengths: np.ndarray
    batch_rows: np.ndarray
    filled: np.ndarray | None = None

    def total(self) -> int:
        return int(self.lengths.sum())

    def offsets(self) -> np.ndarray:
        """Where each entry's rows start."""
        return np.cumsum(self.lengths) - self.lengths

    def own_lengths(self) -> np.ndarray:
        """Each entry's own rows (all of them unless padded)."""
        return self.lengths if self.filled is None else self.filled

    def padding(self) -> np.ndarray | None:
        """Which rows are padding (None: an unpadded pass)."""
        if self.filled is None:
            return None
        return (np.arange(int(self.lengths[0])) >= self.filled[:, None]).ravel()

    def padded(self, width: int) -> "PassRows":
        """Each entry's rows, then padding up to ``width`` rows: the
        ``[entries, width]`` layout a graph replays. A padding row repeats
        its entry's last row (token, hidden state, position: every index
        stays in range); it writes no KV and its output is dropped
        (:meth:`PagedDraftBackend._feed_rows`)."""
        offsets = self.offsets()
        last = offsets + self.lengths - 1
        source = np.minimum(offsets[:, None] + np.arange(width), last[:, None]).ravel()
        at = torch.from_numpy(source).to(self.tokens.device)
        return PassRows(self.tokens[at], self.positions[source], None if self.aux is None else self.aux[at],
                        np.full(self.lengths.size, width, dtype=np.int64), self.batch_rows, self.lengths)

    def split(self, take: np.ndarray) -> tuple["PassRows", "PassRows"]:
        """The first ``take[e]`` rows of each entry (entries taking none left
        out), and the rest."""
        offsets = self.offsets()
        picked = take > 0
        first = self._picked(packed_ranges(offsets[picked], take[picked]), take[picked], self.batch_rows[picked])
        rest = self._picked(packed_ranges(offsets + take, self.lengths - take), self.lengths - take, self.batch_rows)
        return first, rest

    def _picked(self, index: np.ndarray, lengths: np.ndarray, batch_rows: np.ndarray) -> "PassRows":
        at = torch.from_numpy(index).to(self.tokens.device)
        return PassRows(self.tokens[at], self.positions[index], None if self.aux is None else self.aux[at], lengths,
                        batch_rows)


class CommittedPass(NamedTuple):
    """What a variant makes of the step's committed rows: the first pass's
    ``rows``, the committed draft context ``C`` of each of their entries
    (its root row sits at position ``C - 1``), and how many of the rows are
    this step's own (the rest catch up on paused steps)."""

    rows: PassRows | None
    context: np.ndarray
    own_rows: int

    @staticmethod
    def nothing() -> "CommittedPass":
        return CommittedPass(None, np.zeros(0, dtype=np.int64), 0)


class StepRoots(NamedTuple):
    """What the step's first pass leaves for its trees, by batch row: where
    each row's root distribution is in ``distribution`` (``index``, -1:
    none), its committed draft ``context`` (:class:`CommittedPass`), an
    EAGLE-3 head's ``hidden`` state of each root row, and the pass's
    ``block_table``."""

    distribution: DraftDistribution
    index: np.ndarray
    context: np.ndarray
    hidden: torch.Tensor | None
    block_table: torch.Tensor

    def picked(self, values: torch.Tensor, source: np.ndarray, device) -> torch.Tensor:
        """The rows of ``values`` (one per entry of the pass) of trees started
        from entries ``source`` (-1: none, zeros), on ``device``. When the
        trees take every entry in order (a steady step) they are the pass's
        rows as they are: nothing to gather."""
        if np.array_equal(source, np.arange(values.shape[0])):
            return values.to(device)
        index = torch.from_numpy(np.maximum(source, 0)).to(values.device)
        has = torch.from_numpy(source >= 0).to(values.device).view(-1, *([1] * (values.dim() - 1)))
        return torch.where(has, values[index], torch.zeros((), dtype=values.dtype, device=values.device)).to(device)


@dataclass
class TreeScratch:
    """One step's trees as the draft model grows them, per drafting request
    (batch rows ``rows``): the ``roots``' draft distributions, each
    request's committed draft ``context`` length ``C`` and root position,
    the trees' ``state`` (``draft_layer.TreeState``: nodes fed, room,
    depths, ancestor sets), each node id's draft-KV slot (``node_slots``
    [B, N + 1], ``draft_layer.node_slots``), the committed context as the attention reads
    it (``keys``), an EAGLE-3 head's hidden states (``hidden`` per scratch
    column: the nodes, the spill, the root's), the
    contexts on the host (``host_context``, ``longest_context``: the
    attention metadata's bounds), and what a fixed loop's layers share
    (``fixed_shape``, made by its first fed layer).
    Its tensors are where the layer variant keeps them (``draft_layers``)."""

    roots: DraftDistribution
    rows: torch.Tensor
    context: torch.Tensor
    root_position: torch.Tensor
    state: TreeState
    node_slots: torch.Tensor
    block_table: torch.Tensor | None
    keys: tree_step.StepKeys | None = None
    hidden: torch.Tensor | None = None
    host_context: torch.Tensor | None = None
    longest_context: int = 0
    fixed_shape: FixedShape | None = None


class PagedDraftBackend:
    """What both draft models share (:class:`~vllm_adaptive_spec.adapter.draft_head.HeadDraftBackend`,
    :class:`~vllm_adaptive_spec.adapter.draft_lm.LMDraftBackend`): the step's
    committed rows, the first pass, tree layers (as ``layers``, a
    ``draft_layers`` variant, runs them), the forward over vLLM's paged cache."""

    ROWS_AFTER_CHAIN = 0  # rows a first pass feeds beyond a request's committed chain

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

    def _committed_pass(self, committed: Committed, aux_hidden_states) -> CommittedPass:
        raise NotImplementedError

    def _combine(self, aux: torch.Tensor | None) -> torch.Tensor | None:
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
        if rows is None or not len(rows.batch_rows):
            return 0.0
        own_share = committed.own_rows / rows.total()
        width = self._padded_width(committed)
        rows = rows.padded(width) if width else self._feed_oldest(rows, block_table)
        logits, out_hidden, last = self._feed_rows(rows, block_table, drafting)
        if drafting:
            num_reqs = self.runner.input_batch.num_reqs
            index, context = np.full(num_reqs, -1, dtype=np.int64), np.zeros(num_reqs, dtype=np.int64)
            index[rows.batch_rows] = np.arange(len(rows.batch_rows))
            context[rows.batch_rows] = committed.context
            hidden = None if out_hidden is None else out_hidden[last.to(out_hidden.device)]
            self.roots = StepRoots(self.distribution(logits), index, context, hidden, block_table)
        return own_share if drafting else 0.0

    def _committed(self, accepted, sampled, drafting: bool, only_rows) -> Committed:
        """Every request that committed rows this step (:class:`Committed`).
        A tree request's chain is a subset of its scheduled rows, in order
        (node ids rise along a path); the others committed all of theirs.
        Its first row is its first scheduled one, at the position vLLM
        computed from (``num_computed_tokens``: exact here, as the plugin
        refuses asynchronous scheduling), so no position is read back."""
        batch = self.runner.input_batch
        num_reqs = batch.num_reqs
        query_start = self.runner.query_start_loc.np[: num_reqs + 1].astype(np.int64)
        lengths = query_start[1:] - query_start[:-1]
        chains = {i: chain for i, chain in accepted.items() if chain}
        if chains:  # one pass over the rows (a few numpy calls cost more at the batches trees are drafted at)
            starts = query_start.tolist()
            rows = np.fromiter(itertools.chain.from_iterable(
                chains.get(i) or range(starts[i], starts[i + 1]) for i in range(num_reqs)), dtype=np.int64)
            lengths[list(chains)] = [len(c) for c in chains.values()]
        else:
            rows = np.arange(query_start[0], query_start[-1], dtype=np.int64)
        batch_rows = (lengths > 0).nonzero()[0]
        lengths = lengths[batch_rows]
        first = batch.num_computed_tokens_cpu[batch_rows].astype(np.int64)
        following = first + lengths
        next_tokens = np.array([s[-1] if s else -1 for s in sampled[:num_reqs]], dtype=np.int64)[batch_rows]
        missing = next_tokens < 0  # a partial prefill's: the prompt's next token, where the prompt goes on
        if missing.any():
            in_prompt = missing & (following < batch.num_prompt_tokens[batch_rows])
            next_tokens[in_prompt] = batch.token_ids_cpu[batch_rows[in_prompt], following[in_prompt]]
        drafts = np.full(batch_rows.size, drafting)
        if drafting and only_rows is not None:
            drafts = np.isin(batch_rows, np.fromiter(only_rows, dtype=np.int64, count=len(only_rows)))
        return Committed(batch_rows, rows, np.cumsum(lengths), first, next_tokens, drafts)

    def _padded_width(self, committed: CommittedPass) -> int:
        """The rows each request takes in a first pass laid out at fixed
        width, or 0 for a ragged pass. Where the tree layers run at fixed
        capacity (the loop graphs replay), a steady step's pass (no rows
        caught up, no prompt chunk) is ``[entries, width]``: ``width`` is
        the step's widest scheduled request plus the rows the variant feeds
        after a chain (``ROWS_AFTER_CHAIN``), known on the host before the
        step, so the pass's shape depends on the batch and the step's width
        only, not on what was accepted."""
        rows = committed.rows
        if not self.fixed_layers or committed.own_rows != rows.total():
            return 0
        query_start = self.runner.query_start_loc.np
        scheduled = query_start[rows.batch_rows + 1] - query_start[rows.batch_rows]
        width = int(scheduled.max()) + self.ROWS_AFTER_CHAIN
        first = rows.positions[rows.offsets()]
        steady = int(rows.lengths.max()) <= width <= 1 + self.max_nodes + self.ROWS_AFTER_CHAIN
        fits = (width * rows.batch_rows.size <= self.max_pass_rows
                and int(first.max()) + width <= self.runner.max_model_len)
        return width if steady and fits else 0

    def _feed_oldest(self, rows: PassRows, block_table) -> PassRows:
        """While a pass's rows exceed what one draft forward takes (vLLM's
        buffers hold ``max_num_batched_tokens``; a catch-up after a long pause
        holds more), feed each request's oldest rows in a pass of their own,
        keeping at least its last row for the pass that gives the roots; the
        rows left."""
        while rows.total() > self.max_pass_rows:
            spare = rows.lengths - 1
            take = np.clip(self.max_pass_rows - (np.cumsum(spare) - spare), 0, spare)
            if not take.any():  # a row per request is more than a pass takes: vLLM schedules no such step
                return rows
            oldest, rows = rows.split(take)
            self._feed_rows(oldest, block_table, logits=False)
        return rows

    def _feed_rows(self, rows: PassRows, block_table, logits: bool):
        """One draft forward over ``rows``: the logits and hidden states of
        each entry's last own row (no logits unless ``logits``), and those
        rows' indexes. An entry's ``k``-th row sits at position ``p0 + k``
        and sees keys up to it under the causal kernel (``seq_len = p0 +
        length``); a padding row's slot is -1 (no KV written)."""
        offsets = rows.offsets()
        starts = torch.zeros(len(offsets) + 1, dtype=torch.int32)
        starts[1:] = torch.from_numpy(offsets + rows.lengths)
        positions = torch.from_numpy(rows.positions)
        slots = self.slots(block_table, torch.from_numpy(np.repeat(rows.batch_rows, rows.lengths)), positions)
        padding = rows.padding()
        if padding is not None:
            slots = slots.masked_fill(torch.from_numpy(padding).to(slots.device), -1)
        seq_lens = (rows.positions[offsets] + rows.lengths).astype(np.int32)
        seq_lens_t = torch.from_numpy(seq_lens)
        layout = PassLayout(starts, seq_lens_t, seq_lens_t, block_table[torch.from_numpy(rows.batch_rows)],
                            int(rows.lengths.max()), int(seq_lens.max()))
        last = torch.from_numpy(offsets + rows.own_lengths() - 1)
        out_logits, out_hidden = self.run(rows.tokens, positions, self._combine(rows.aux), slots, layout,
                                          logit_rows=last if logits else last[:0])
        return out_logits, out_hidden, last

    # -- tree growth ----------------------------------------------------------------
    def begin(self, rows: list[int]) -> TreeScratch:
        """Start one tree per drafting request (batch rows): the roots' draft
        distributions, ``[B, top_k]`` (zero probabilities where a request has
        none), and the scratch its layers grow, where the layer variant keeps
        them (from a first pass on the same device, nothing is read back)."""
        roots, device = self.roots, self.device
        rows_np = np.asarray(rows, dtype=np.int64)
        source = np.full(rows_np.size, -1, dtype=np.int64) if roots is None else roots.index[rows_np]
        ready = source >= 0
        committed = np.where(ready, 0 if roots is None else roots.context[rows_np], 0)
        block_table = self.runner.input_batch.block_table[0]
        room = block_table.num_blocks_per_row[rows_np].astype(np.int64) * block_table.block_size - committed
        distribution = self._root_distributions(source, device)
        rows_t, committed_t = torch.from_numpy(rows_np), torch.from_numpy(committed)
        room_t = torch.from_numpy(np.where(ready, np.clip(room, 0, self.max_nodes), 0)).to(device)
        rows_d, committed_d = rows_t.to(device), committed_t.to(device)
        return TreeScratch(
            roots=distribution,
            rows=rows_d,
            context=committed_d,
            root_position=torch.from_numpy(np.maximum(committed - 1, 0)).to(device),
            state=empty_state(room_t, self.max_nodes),
            node_slots=self._node_slots(None if roots is None else roots.block_table, rows_d, committed_d, room_t),
            block_table=None if roots is None else roots.block_table,
            keys=None if roots is None else tree_step.StepKeys(committed_t, roots.block_table[rows_t]),
            host_context=committed_t,
            longest_context=int(committed.max(initial=0)),
        )

    def _root_distributions(self, source: np.ndarray, device: torch.device) -> DraftDistribution:
        """The roots' distributions, ``[B, top_k]``, of the first pass's
        entries ``source`` (-1: none, zero probabilities)."""
        if self.roots is None:
            return empty_distribution((source.size,), self.top_k, device)
        return DraftDistribution(*(self.roots.picked(x, source, device) for x in self.roots.distribution))

    def feed(self, scratch: TreeScratch, live: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
        """Run the draft model on the live frontier nodes ``[B, F]``; their
        node ids (-1: not fed) and draft distributions, ``[B, F, top_k]``,
        as the backend's layer variant (``draft_layers``) runs them (an
        unfed node's distribution is undefined: mask it by its node id)."""
        return self.layers.feed(self, scratch, live, tokens, parents)

    def _node_slots(self, block_table, rows: torch.Tensor, context: torch.Tensor, room: torch.Tensor) -> torch.Tensor:
        """Each node id's draft-KV slot (``draft_layer.node_slots``), none
        without a first pass this step (then no tree has room)."""
        if block_table is None:
            return torch.full((rows.shape[0], self.max_nodes + 1), -1, dtype=torch.long, device=rows.device)

        def kv_slots(positions: torch.Tensor) -> torch.Tensor:
            return self.slots(block_table, rows.unsqueeze(1).expand_as(positions), positions)

        return node_slots(context, room, self.max_nodes, kv_slots)

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
        it has one. Where vLLM captured the draft model's PIECEWISE CUDA
        graphs (its drafter's, for every capture size) the forward replays
        them (:meth:`_graph_inputs`)."""
        native = self.native
        num_tokens = int(tokens.shape[0])
        device = self.runner.device
        tokens, positions, slots = tokens.to(device), positions.to(device), slots.to(device)
        hidden = None if hidden is None else hidden.to(device)
        mode, num_input, across_dp = native._determine_batch_execution_and_padding(num_tokens)
        num_input = self.layers.pass_rows(num_tokens, num_input, native.input_ids.shape[0])
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
        eager = mode == CUDAGraphMode.NONE and num_input == num_tokens and not self.layers.padded
        inputs = (tokens, positions, hidden) if eager else self._graph_inputs(tokens, positions, hidden, num_input)
        with set_forward_context(per_layer, native.vllm_config, num_tokens=num_input, num_tokens_across_dp=across_dp,
                                 cudagraph_runtime_mode=mode, slot_mapping=native._get_slot_mapping(num_input, slots)):
            normed, prenorm = self._forward(*inputs)
        if not eager:  # a staged pass's rows, less the padding of a capture size (the same operations with none)
            normed, prenorm = normed[:num_tokens], None if prenorm is None else prenorm[:num_tokens]
        if logit_rows is not None:
            normed = normed[logit_rows.to(device)]
        if self._target_ids() is not None:
            return native.model.logits_processor(native.model.lm_head, normed), prenorm
        return native.model.compute_logits(normed), prenorm

    def _graph_inputs(self, tokens, positions, hidden, num_input: int):
        """The pass's inputs in the drafter's persistent buffers, padded to
        ``num_input`` rows (the capture size vLLM dispatched): a CUDA graph
        replays reads from the addresses it was captured with (vLLM's
        ``dummy_run`` captured them from these buffers). Padding rows keep
        whatever an earlier pass left (valid tokens and positions); they
        write no KV (slot -1) and their outputs are dropped."""
        native, num_tokens = self.native, int(tokens.shape[0])
        native.input_ids[:num_tokens].copy_(tokens)
        native._set_positions(num_tokens, positions)
        staged = None
        if hidden is not None:
            native.hidden_states[:num_tokens].copy_(hidden)
            staged = native.hidden_states[:num_input]
        return native.input_ids[:num_input], native._get_positions(num_input), staged

    def distribution(self, logits: torch.Tensor) -> DraftDistribution:
        """The pass's distributions, tokens in the target's vocabulary (ties:
        the lower draft id first, the target's order where ``d2t`` ascends)."""
        dist = draft_distribution(logits, self.top_k, self.top_m)
        target_ids = self._target_ids()
        return dist if target_ids is None else dist._replace(tokens=target_ids[dist.tokens])

