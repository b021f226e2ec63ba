"""How a model drafter's tree layer reaches the draft model: two variants
over one layout (``layer_layout.lay_out_layer``), chosen by the step mode
(``ragged_or_uniform``, from the ``step_shape`` setting).

* :class:`RaggedLayers` (ragged steps'): the forward takes the fed rows only, and
  a layer shaped like a chain goes to vLLM's own kernel. Finding those rows
  reads the layer's layout back once, which costs nothing where the layout
  already is (the host), and on the CPU every padded row would cost a row.
* :class:`FixedLayers` (uniform steps', the step CUDA graphs replay): every
  layer is ``B x F`` rows whatever was fed. Unfed rows are padding: they
  write no KV (slot ``-1``), see no tree node, and their outputs are
  discarded. The trees' scratch, the layout and the distributions stay on
  the device, and the attention metadata's host values are bounds known
  before the loop (``F`` rows a request; the committed context plus the
  scratch), so the draft loop reads nothing back and its shapes depend on
  the batch, the width and the depth only: what a graph per layer replays.
  ``growth.grow`` then grows at fixed capacity (``growth.grow_fixed``).
  Where no graph replays the step (the CPU), every forward is padded to the
  plugin's batch sizes and staged in the draft model's persistent buffers
  as a replay's would be (``padded``), so that path runs there too.
"""

from __future__ import annotations

import itertools
from typing import NamedTuple

import torch

from kernels.draft_distribution import DraftDistribution
from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.trees.layer_layout import LayerRows, lay_out_layer
from vllm_adaptive_spec.trees.uniform_widths import padded_rows


class PassLayout(NamedTuple):
    """What vLLM's attention metadata of one draft forward needs:
    ``query_start_loc`` (host, int32), the ``seq_lens`` the kernels read
    (beside the rows), their host upper bound ``seq_lens_bound``, the
    requests' ``block_table`` rows, and the longest query and sequence as
    host ints."""

    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_bound: torch.Tensor
    block_table: torch.Tensor
    max_query_len: int
    max_seq_len: int


def empty_distribution(shape: tuple[int, ...], top_k: int, device: torch.device | str = "cpu") -> DraftDistribution:
    """Zero probabilities (no candidates) for ``shape`` nodes."""
    return DraftDistribution(
        torch.zeros(*shape, top_k, dtype=torch.long, device=device), torch.zeros(*shape, top_k, device=device),
        torch.zeros(shape, device=device), torch.zeros(shape, device=device),
    )


def _laid_out(scratch, live: torch.Tensor, parents: torch.Tensor) -> LayerRows:
    """The layer's rows (``lay_out_layer``); the scratch's trees move on."""
    scratch.state, rows = lay_out_layer(scratch.state, live, parents, scratch.root_position, scratch.node_slots)
    return rows


def _input_hidden(scratch, rows: LayerRows) -> torch.Tensor | None:
    """Each frontier slot's input hidden state ``[B, F, H]`` (an EAGLE-3
    head's; None for a draft LM): its parent's output, from its parent's
    column (a child of the root: the root's, the first pass's last row)."""
    if scratch.hidden is None:
        return None
    columns = rows.parent_column.to(scratch.hidden.device).unsqueeze(-1)
    return scratch.hidden.gather(1, columns.expand(-1, -1, scratch.hidden.shape[-1]))


class _FedRows(NamedTuple):
    """A ragged layer's fed slots, from each request's count of them (the
    layer's one read): the ``requests`` with any, their ``counts`` and the
    pass's ``starts`` (its ``query_start_loc``, made on the host from the
    counts), and where ``every`` slot is fed (a chain's layers, a full
    layer) nothing else, the rows then being the layer's own in its order
    and each index a view; else the fed slots' indexes ``b_idx``, ``f_idx``.
    Decision: a step drafts 3-8 layers, and on the CPU each operation a
    layer drops is a few microseconds of the drafting step's host time."""

    counts: list[int]
    every: bool
    requests: torch.Tensor
    starts: torch.Tensor
    b_idx: torch.Tensor | None
    f_idx: torch.Tensor | None

    @staticmethod
    def of(rows: LayerRows, width: int) -> "_FedRows | None":
        counts = rows.fed.sum(1).tolist()
        if not any(counts):
            return None
        if min(counts) == width:
            starts = torch.arange(0, width * len(counts) + 1, width, dtype=torch.int32)
            return _FedRows(counts, True, torch.arange(len(counts)), starts, None, None)
        b_idx, f_idx = rows.fed.nonzero(as_tuple=True)
        requests = [b for b, n in enumerate(counts) if n]
        counts = [counts[b] for b in requests]
        starts = torch.tensor([0, *itertools.accumulate(counts)], dtype=torch.int32)
        return _FedRows(counts, False, torch.tensor(requests), starts, b_idx, f_idx)

    def of_requests(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [B, ...] of the requests with fed slots."""
        return values if self.every else values[self.requests]

    def pick(self, values: torch.Tensor) -> torch.Tensor:
        """``values`` [B, F, ...] of the fed slots, request after request."""
        return values.flatten(0, 1) if self.every else values[self.b_idx, self.f_idx]

    def put(self, scratch: torch.Tensor, columns: torch.Tensor, values: torch.Tensor) -> None:
        """Write the fed slots' ``values`` into ``scratch`` [B, N + 2, H] at their ``columns`` [B, F]."""
        if self.every:
            batch, width = columns.shape
            scratch.scatter_(1, columns.unsqueeze(-1).expand(-1, -1, values.shape[-1]), values.view(batch, width, -1))
        else:
            scratch[self.b_idx, columns[self.b_idx, self.f_idx]] = values


class RaggedLayers:
    """A layer's fed rows only, its scratch on the host."""

    fixed = False
    padded = False  # forwards run eagerly where no graph replays
    device = torch.device("cpu")
    padded_passes = 0

    def pass_rows(self, num_tokens: int, dispatched: int, limit: int) -> int:
        """The rows a draft forward of ``num_tokens`` rows runs: what vLLM's dispatcher chose."""
        return dispatched

    def feed(self, backend, scratch, live: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
        """Run the draft model on the live frontier nodes; their node ids
        (-1: not fed) and draft distributions, ``[B, F, top_k]``."""
        rows = _laid_out(scratch, live, parents)
        fed = _FedRows.of(rows, live.shape[1])
        if fed is None:
            return rows.node, empty_distribution(live.shape, backend.top_k)
        starts = fed.starts
        window = fed.of_requests(scratch.state.count)
        seq_lens = (fed.of_requests(scratch.context) + window).to(torch.int32)
        hidden = _input_hidden(scratch, rows)
        mask = fed.pick(rows.visible)[:, : int(window.max())]
        layout = PassLayout(starts, seq_lens, seq_lens, scratch.block_table[fed.of_requests(scratch.rows)],
                            max(fed.counts), int(seq_lens.max()))
        # A row per request that sees its whole tree: a chain's layer, plain causal decoding (vLLM's own kernel).
        chain = max(fed.counts) == 1 and bool((mask.sum(1) == window).all())
        with tree_step.published(None if chain else self._layer_step(backend, fed, starts, mask, window,
                                                                      scratch.keys)):
            logits, out_hidden = backend.run(fed.pick(tokens), fed.pick(rows.position),
                                             None if hidden is None else fed.pick(hidden), fed.pick(rows.slot), layout)
        if scratch.hidden is not None:
            fed.put(scratch.hidden, rows.column, out_hidden)
        dist = DraftDistribution(*(x.to(self.device) for x in backend.distribution(logits)))
        if fed.every:  # the rows in the layer's order
            return rows.node, _shaped(live.shape, dist)
        out = empty_distribution(live.shape, backend.top_k)
        for mine, theirs in zip(out, dist):
            mine[fed.b_idx, fed.f_idx] = theirs
        return rows.node, out

    @staticmethod
    def _layer_step(backend, fed: "_FedRows", starts, mask, window, keys) -> tree_step.DraftStep:
        """The layer's rows for the tree path."""
        device = backend.runner.device
        return tree_step.DraftStep(
            batch_indices=torch.arange(fed.requests.shape[0], device=device),
            query_rows=torch.arange(int(starts[-1]), device=device),
            query_start_loc=starts.to(device),
            query_mask=mask.to(device),
            window_lens=window.to(device, torch.int32),
            max_query_len=max(fed.counts),
            step_keys=keys,
            step_requests=fed.requests,
        )


class FixedShape(NamedTuple):
    """What every ``B x F`` layer of one step's fixed loop shares, made at
    its first fed layer (the root layer feeds nothing): the pass's host
    ``query_start_loc`` and its copy on the device, the sequence bound
    (committed context plus the scratch), the requests' block-table rows,
    and the rows' and requests' indexes."""

    width: int
    starts: torch.Tensor
    device_starts: torch.Tensor
    bound: torch.Tensor
    block_table: torch.Tensor
    requests: torch.Tensor
    rows: torch.Tensor
    host_requests: torch.Tensor

    @staticmethod
    def of(backend, scratch, batch: int, width: int, device: torch.device) -> "FixedShape":
        starts = torch.arange(batch + 1, dtype=torch.int32) * width
        return FixedShape(width, starts, starts.to(device), (scratch.host_context + backend.max_nodes).to(torch.int32),
                          scratch.block_table[scratch.rows], torch.arange(batch, device=device),
                          torch.arange(batch * width, device=device), torch.arange(batch))


class FixedLayers:
    """Every layer ``B x F`` rows on ``device``, nothing read back (see the module)."""

    fixed = True

    def __init__(self, device: torch.device, padded: bool = False) -> None:
        self.device = device
        # Pad every forward as graphs would, where none do (the CPU's uniform steps), each one
        # staged in the persistent buffers as a replay reads them, padded or not.
        self.padded = padded
        self.padded_passes = 0

    def pass_rows(self, num_tokens: int, dispatched: int, limit: int) -> int:
        """The rows a draft forward of ``num_tokens`` rows runs: what vLLM's
        dispatcher chose (a graph's capture size), or with ``padded`` and no
        graph the next of the plugin's batch sizes, the forward then staged in
        the draft model's persistent buffers as a replay's would be."""
        if not self.padded or dispatched != num_tokens:
            return dispatched
        rows = padded_rows(num_tokens, limit)
        self.padded_passes += rows != num_tokens
        return rows

    def feed(self, backend, scratch, live: torch.Tensor, tokens: torch.Tensor, parents: torch.Tensor):
        """As :meth:`RaggedLayers.feed`, over every frontier slot; an unfed
        slot's distribution is whatever its padding row gave (the caller
        masks by node id: zeroing them would cost a dozen operations a layer)."""
        rows = _laid_out(scratch, live, parents)
        batch, width = live.shape
        if scratch.block_table is None:  # known before the loop: no first pass, no trees
            return rows.node, empty_distribution(live.shape, backend.top_k, self.device)
        shape = scratch.fixed_shape
        if shape is None or shape.width != width:
            shape = scratch.fixed_shape = FixedShape.of(backend, scratch, batch, width, self.device)
        layout = PassLayout(shape.starts, (scratch.context + scratch.state.count).to(torch.int32), shape.bound,
                            shape.block_table, width, scratch.longest_context + backend.max_nodes)
        hidden = _input_hidden(scratch, rows)
        step = tree_step.DraftStep(
            batch_indices=shape.requests,
            query_rows=shape.rows,
            query_start_loc=shape.device_starts,
            query_mask=rows.visible.flatten(0, 1),
            window_lens=scratch.state.count.to(torch.int32),
            max_query_len=width,
            step_keys=scratch.keys,
            step_requests=shape.host_requests,
        )
        with tree_step.published(step):
            logits, out_hidden = backend.run(tokens.flatten(), rows.position.flatten(),
                                             None if hidden is None else hidden.flatten(0, 1), rows.slot.flatten(),
                                             layout)
        if scratch.hidden is not None:
            size = scratch.hidden.shape[-1]
            scratch.hidden.scatter_(1, rows.column.unsqueeze(-1).expand(-1, -1, size),
                                    out_hidden.view(batch, width, size))
        return rows.node, _shaped(live.shape, backend.distribution(logits))


def _shaped(shape: torch.Size, dist: DraftDistribution) -> DraftDistribution:
    """``[B * F]`` rows' distributions as ``[B, F]`` (unfed rows' as they came out: masked by the caller)."""
    return DraftDistribution(*(x.view(*shape, *x.shape[1:]) for x in dist))
