"""The tree layout of the current forward, shared by the runner (which builds
it), the attention impl and the verifier (which read it): a target step
(:class:`TreeStep`) or one tree-drafting pass (:class:`DraftStep`).

vLLM's attention metadata has no channel for a per-request mask, so a step
is published here, by :func:`published` only, for the phases that read it:
the runner's step from its layout to its verification (while vLLM picks
its graph, runs the forward and samples), a drafting pass for its forward,
a graph's capture for the capture. Dummy and profiling runs see ``None``
and stay causal.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

from vllm_adaptive_spec.step.transfer import packed_to_device, to_device
from vllm_adaptive_spec.trees.packed_ranges import packed_ranges
from vllm_adaptive_spec.trees.tree import DraftTree, HostTrees, TreeBatch
from vllm_adaptive_spec.trees.tree_buffers import TreeBuffers
from vllm_adaptive_spec.trees.tree_tensors import TreeTensors, row_visibility


@dataclass
class AttentionRows:
    """Query rows the tree path of the attention computes: rows
    ``query_rows`` of requests ``batch_indices``, each request's rows at
    ``query_start_loc``, seeing its context and, of its last ``window_lens``
    keys (default: its query rows), those ``query_mask`` [T, W] marks.
    ``max_query_len``: the most rows of one request, on the host (the CUDA
    kernel would otherwise read it off the device)."""

    batch_indices: torch.Tensor
    query_rows: torch.Tensor
    query_start_loc: torch.Tensor
    query_mask: torch.Tensor
    max_query_len: int
    window_lens: torch.Tensor | None = None
    page_plan: object = None  # the attention's plan, built by the pass's first layer


@dataclass(frozen=True)
class UniformRows:
    """A uniform tree step's rows, as a captured CUDA graph reads them: every
    request of the batch has ``rows`` rows, and row ``t`` sees row ``j`` of
    its request where ``mask[t, j]`` (a persistent ``[max tokens, max rows]``
    buffer the runner fills before the step). Every row of the pass takes
    the tree kernel's graph-safe launch over vLLM's own persistent metadata."""

    mask: torch.Tensor
    rows: int


@dataclass
class StepKeys:
    """The committed draft context of one drafting step's requests, the same
    for every tree layer's pass: its ``lengths`` [n] and the requests'
    block-table rows [n, nb]. ``cache``: what an attention impl keeps between
    the step's passes (the CPU's: each cache's context keys, gathered once)."""

    lengths: torch.Tensor
    block_table: torch.Tensor
    cache: dict = field(default_factory=dict)


@dataclass
class DraftStep:
    """One drafting pass: every row is a tree node of request ``batch_indices``
    (rows of the pass's block table), seeing the committed draft context and,
    of the request's last ``window_lens`` cached keys (its tree so far), those
    ``query_mask`` [T, W] marks (ancestors and itself). ``step_keys``: the
    step's context, ``step_requests`` [B] the pass's requests among its."""

    batch_indices: torch.Tensor
    query_rows: torch.Tensor
    query_start_loc: torch.Tensor
    query_mask: torch.Tensor
    window_lens: torch.Tensor
    max_query_len: int  # the most rows of one request, on the host
    page_plan: object = None  # the attention's plan, built by the pass's first layer
    step_keys: StepKeys | None = None
    step_requests: torch.Tensor | None = None


@dataclass
class TreeStep:
    """Requests of this step that carry a draft tree, in batch order.

    ``batch_indices`` [Bt]: their rows in vLLM's input batch; ``trees``: their
    (possibly truncated) trees; ``tree_batch``: the same, padded;
    ``query_rows`` [Tt]: the flattened query rows of those requests;
    ``query_start_loc`` [Bt + 1]: offsets into ``query_rows``;
    ``query_mask`` [Tt, W]: which of its request's query rows each row sees;
    ``ancestors`` [Bt, N, N]: the trees' ancestor-or-self masks.
    On the host, so that laying out the step and reading its acceptance need
    nothing back from the device: ``host_batch_indices``, ``host_first_rows``
    (each request's first query row in the batch) and ``host_root_rows``
    (each tree's root row) as lists. On the device: ``node_rows`` / ``node_offsets``, each node's query
    row and its depth position's offset from the row's sequential one
    (``depth - 1 - node index``), and ``root_rows``.
    """

    batch_indices: torch.Tensor
    trees: list[DraftTree]
    tree_batch: TreeBatch
    ancestors: torch.Tensor
    query_rows: torch.Tensor
    query_start_loc: torch.Tensor
    query_mask: torch.Tensor
    host_batch_indices: list[int]
    host_first_rows: list[int]
    host_root_rows: list[int]
    node_rows: torch.Tensor
    node_offsets: torch.Tensor
    root_rows: torch.Tensor
    # The rows of requests whose tree branches; a chain's rows are exact
    # under vLLM's causal kernel (None: every tree is a chain).
    attention: AttentionRows | None = None
    uniform: UniformRows | None = None  # a uniform step's rows, when graphs replay it
    # Per tree, whether it is its grammar's forced tokens rather than the
    # drafter's (``tree_scheduler``: kept out of the drafter's statistics).
    forced: tuple[bool, ...] = ()

    @property
    def causal(self) -> bool:
        return self.attention is None


_current: TreeStep | DraftStep | UniformRows | None = None


def current() -> TreeStep | DraftStep | UniformRows | None:
    """The step published now, if any."""
    return _current


@contextmanager
def published(step: TreeStep | DraftStep | UniformRows | None):
    """``step`` published for the duration (``None``: every row causal);
    what was published before comes back after (a uniform step's capture
    runs vLLM's phases inside it)."""
    global _current
    previous, _current = _current, step
    try:
        yield step
    finally:
        _current = previous


def uniform_rows(step) -> UniformRows | None:
    """The graph-safe rows of the published step, if it has them."""
    return step if isinstance(step, UniformRows) else getattr(step, "uniform", None)


def build_step(
    batch_indices: list[int],
    trees: list[DraftTree],
    query_starts: list[int],
    query_lens: list[int],
    device: torch.device,
    paddings: list[int] | None = None,
) -> TreeStep:
    """Lay out the trees of one step. A request's tree occupies ``1 + n`` of
    its query rows (root, then nodes), followed by its ``paddings`` rows (the
    ``-1`` drafts of a uniform step, ``uniform_widths``), which see the rows up
    to the root and which no row sees; earlier rows (if any) are causal, and
    every tree row sees them all. Only the requests whose tree branches need
    the tree path of the attention (:class:`AttentionRows`).
    Built on the host as numpy arrays for all requests at once (no loop over
    them); everything the device needs arrives in one pinned, non-blocking
    copy (:func:`~vllm_adaptive_spec.step.transfer.packed_to_device`)."""
    host = HostTrees.of(trees)
    starts, lengths = np.asarray(query_starts, dtype=np.int64), np.asarray(query_lens, dtype=np.int64)
    before = lengths - 1 - host.num_nodes - (0 if paddings is None else np.asarray(paddings, dtype=np.int64))
    query_rows = packed_ranges(starts, lengths)
    request = np.repeat(np.arange(len(trees)), lengths)
    query_mask = _row_masks(host, request, query_rows - starts[request], before, int(lengths.max()))
    roots = starts + before
    valid = host.valid
    node_offsets = host.depths()[valid] - 1 - np.nonzero(valid)[1]
    parts = [np.asarray(batch_indices, dtype=np.int64), host.tokens, host.parents, host.num_nodes, host.ancestors,
             query_rows, np.concatenate([[0], np.cumsum(lengths)]), query_mask,
             packed_ranges(roots + 1, host.num_nodes), node_offsets, roots]
    branching = np.flatnonzero(host.branches())
    if branching.size:
        mine, widest = np.isin(request, branching), int(lengths[branching].max())
        parts += [parts[0][branching], query_rows[mine], np.concatenate([[0], np.cumsum(lengths[branching])]),
                  query_mask[mine, :widest]]
    moved = packed_to_device(parts, device)
    indices, tokens, parents, num_nodes, ancestors_d, rows_d, query_start_loc, mask_d, n_rows, n_offsets = moved[:10]
    attention = None
    if branching.size:
        b_indices, b_rows, b_starts, b_mask = moved[11:]
        attention = AttentionRows(batch_indices=b_indices, query_rows=b_rows, query_start_loc=b_starts.to(torch.int32),
                                  query_mask=b_mask.bool(), max_query_len=widest)
    return TreeStep(
        batch_indices=indices,
        trees=trees,
        tree_batch=TreeBatch(tokens, parents, num_nodes),
        ancestors=ancestors_d.bool(),
        query_rows=rows_d,
        query_start_loc=query_start_loc.to(torch.int32),
        query_mask=mask_d.bool(),
        host_batch_indices=list(batch_indices),
        host_first_rows=list(query_starts),
        host_root_rows=roots.tolist(),
        node_rows=n_rows,
        node_offsets=n_offsets,
        root_rows=moved[10],
        attention=attention,
    )


def _row_masks(host: HostTrees, request: np.ndarray, local: np.ndarray, before: np.ndarray, width: int) -> np.ndarray:
    """[T, width] which of its request's query rows each row sees (row
    ``local`` of request ``request``; ``before``: each request's rows ahead
    of its root): causal, except in the tree's block (the root, then each
    node seeing the root, its ancestors and itself) and for the padding rows
    after it (they see the rows up to the root)."""
    row, column = local[:, None], np.arange(width)[None, :]
    first, size = before[request][:, None], 1 + host.num_nodes[request][:, None]
    nodes = host.tokens.shape[1]
    block = np.zeros((len(host.num_nodes), 1 + nodes, 1 + nodes), dtype=bool)
    block[:, :, 0] = True
    block[:, 1:, 1:] = host.ancestors
    in_tree = (row >= first) & (row < first + size) & (column >= first) & (column < first + size)
    seen = block[request[:, None], np.clip(row - first, 0, nodes), np.clip(column - first, 0, nodes)]
    mask = np.where(in_tree, seen, column <= row)
    return mask & ~((row >= first + size) & (column > first))


def build_uniform_step(
    slots: list[int], trees: list[DraftTree], rows: int, buffers: TreeBuffers, device: torch.device,
) -> TreeStep:
    """Lay out a uniform step (every request of the batch ``rows`` query
    rows: root, its tree's nodes, then padding; ``uniform_widths``) from the
    persistent tree buffers: the trees (of batch rows ``slots``) travel in
    one pinned, non-blocking copy, and every row index, position offset and
    mask is derived from them on the device, in operations whose count
    depends on neither the batch nor the width (:func:`uniform_layout`).
    The same layout as :func:`build_step` gives such a step, at the step's
    width; every tree's rows take the tree path (:class:`AttentionRows`),
    unless a captured graph replays the step (``TreeStep.uniform``)."""
    index = buffers.write(to_device(buffers.host_rows(slots, trees), torch.long, device))
    layout = uniform_layout(buffers.read(index, rows - 1), index)
    host_first_rows = [slot * rows for slot in slots]
    return TreeStep(
        batch_indices=index,
        trees=trees,
        tree_batch=layout.tree.batch,
        ancestors=layout.tree.ancestors,
        query_rows=layout.query_rows,
        query_start_loc=layout.query_start_loc,
        query_mask=layout.query_mask,
        host_batch_indices=list(slots),
        host_first_rows=host_first_rows,
        host_root_rows=host_first_rows,
        node_rows=layout.node_rows,
        node_offsets=layout.node_offsets,
        root_rows=layout.root_rows,
        attention=AttentionRows(batch_indices=index, query_rows=layout.query_rows,
                                query_start_loc=layout.query_start_loc, query_mask=layout.query_mask,
                                max_query_len=rows),
    )


class UniformDeviceLayout(NamedTuple):
    """The device part of a uniform step's layout (:func:`uniform_layout`)."""

    tree: TreeTensors
    query_rows: torch.Tensor
    query_start_loc: torch.Tensor
    query_mask: torch.Tensor
    node_rows: torch.Tensor
    node_offsets: torch.Tensor
    root_rows: torch.Tensor


def uniform_layout(tree: TreeTensors, index: torch.Tensor) -> UniformDeviceLayout:
    """Every row index, depth offset and mask of a uniform step whose
    requests (batch rows ``index``) have ``1 + W`` rows each, from their
    trees read at width ``W``: operations whose count depends on neither
    the batch nor the width, with no value read back (what a graph replays)."""
    batch, width = tree.tokens.shape
    rows = width + 1
    base = index * rows  # each request's first row, its root's
    nodes = torch.arange(width, device=base.device)
    return UniformDeviceLayout(
        tree=tree,
        query_rows=(base.unsqueeze(1) + torch.arange(rows, device=base.device)).flatten(),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=base.device) * rows,
        query_mask=row_visibility(tree).flatten(0, 1),
        node_rows=(base.unsqueeze(1) + 1 + nodes).flatten(),
        node_offsets=torch.where(tree.valid(), tree.depth - 1 - nodes, 0).flatten(),
        root_rows=base,
    )
