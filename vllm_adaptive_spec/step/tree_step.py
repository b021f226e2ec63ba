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

import torch

from vllm_adaptive_spec.step.transfer import packed_to_device, to_device
from vllm_adaptive_spec.trees.row_layout import RowLayout, lay_out_rows
from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch
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
    """Lay out the trees of one step (``row_layout``: which rows a tree
    takes, which rows each sees, its ``paddings``); only the requests whose
    tree branches need the tree path of the attention
    (:class:`AttentionRows`). Built on the host in plain lists; everything
    the device needs arrives in one conversion and one pinned, non-blocking
    copy (:func:`~vllm_adaptive_spec.step.transfer.packed_to_device`)."""
    host = lay_out_rows(trees, query_starts, query_lens, paddings or [0] * len(trees))
    batch, nodes, width = len(trees), host.nodes, host.width
    parts = [(batch_indices, (batch,)), (host.tokens, (batch, nodes)), (host.parents, (batch, nodes)),
             (host.num_nodes, (batch,)), (host.ancestors, (batch, nodes, nodes)), (host.query_rows, (-1,)),
             (host.query_start_loc, (batch + 1,)), (host.query_mask, (-1, width)), (host.node_rows, (-1,)),
             (host.node_offsets, (-1,)), (host.roots, (batch,))]
    if host.branching:
        parts += _branching_parts(host, batch_indices, query_lens)
    moved = packed_to_device([part for part, _ in parts], [shape for _, shape in parts], device)
    indices, tokens, parents, num_nodes, ancestors, rows, query_start_loc, mask, node_rows, node_offsets, roots = moved[:11]
    attention = None
    if host.branching:
        b_indices, b_rows, b_starts, b_mask = moved[11:]
        attention = AttentionRows(batch_indices=b_indices, query_rows=b_rows, query_start_loc=b_starts.to(torch.int32),
                                  query_mask=b_mask.bool(), max_query_len=b_mask.shape[1])
    return TreeStep(
        batch_indices=indices,
        trees=trees,
        tree_batch=TreeBatch(tokens, parents, num_nodes),
        ancestors=ancestors.bool(),
        query_rows=rows,
        query_start_loc=query_start_loc.to(torch.int32),
        query_mask=mask.bool(),
        host_batch_indices=list(batch_indices),
        host_first_rows=list(query_starts),
        host_root_rows=host.roots,
        node_rows=node_rows,
        node_offsets=node_offsets,
        root_rows=roots,
        attention=attention,
    )


def _branching_parts(host: RowLayout, batch_indices: list[int], query_lens: list[int]) -> list[tuple[list[int], tuple]]:
    """The branching requests' rows for :class:`AttentionRows`: their batch
    indices, query rows, row offsets and masks, cut to their widest request."""
    widest = max(query_lens[k] for k in host.branching)
    firsts = host.query_start_loc
    rows, starts, mask = [], [0], []
    for k in host.branching:
        rows.extend(host.query_rows[firsts[k]: firsts[k + 1]])
        starts.append(starts[-1] + query_lens[k])
        for row in range(firsts[k], firsts[k + 1]):
            mask.extend(host.query_mask[row * host.width: row * host.width + widest])
    return [([batch_indices[k] for k in host.branching], (len(host.branching),)), (rows, (-1,)),
            (starts, (len(host.branching) + 1,)), (mask, (-1, widest))]


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
