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

import itertools
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from vllm_adaptive_spec.adapter.transfer import packed_to_device, to_device
from vllm_adaptive_spec.tree import DraftTree, TreeBatch
from vllm_adaptive_spec.tree_buffers import TreeBuffers
from vllm_adaptive_spec.tree_tensors import row_visibility


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
    host_query_mask: torch.Tensor | None = None  # ``query_mask`` on the host
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
    ``-1`` drafts of a uniform step, ``step_widths``), which see the rows up
    to the root and which no row sees; earlier rows (if any) are causal, and
    every tree row sees them all. Only the requests whose tree branches need
    the tree path of the attention (:class:`AttentionRows`).
    Built on the host; everything the device needs arrives in one pinned,
    non-blocking copy (:func:`~vllm_adaptive_spec.adapter.transfer.packed_to_device`)."""
    host_batch = TreeBatch.from_trees(trees)
    ancestors = host_batch.ancestor_mask()
    row_masks = host_batch.row_mask(ancestors)
    depths = ancestors.sum(-1)
    width = max(query_lens)
    paddings = paddings or [0] * len(trees)
    masks, rows, starts, node_rows, node_offsets, roots = [], [], [0], [], [], []
    for b, (start, length, tree, pad) in enumerate(zip(query_starts, query_lens, trees, paddings)):
        offset = length - 1 - len(tree) - pad
        mask = torch.ones(length, width, dtype=torch.bool).tril()
        size = 1 + len(tree)
        mask[offset:offset + size, offset:offset + size] = row_masks[b, :size, :size]
        mask[offset + size:, offset + 1:] = False
        masks.append(mask)
        rows.append(torch.arange(start, start + length))
        starts.append(starts[-1] + length)
        roots.append(start + offset)
        node_rows.append(rows[-1][offset + 1: offset + size])
        node_offsets.append(depths[b, : len(tree)] - torch.arange(1, len(tree) + 1))
    branching = [k for k, tree in enumerate(trees) if tree.branches()]
    lengths = [query_lens[k] for k in branching]
    host_query_mask = torch.cat(masks)
    host = [
        torch.tensor(batch_indices), host_batch.tokens, host_batch.parents, host_batch.num_nodes, ancestors,
        torch.cat(rows), torch.tensor(starts), host_query_mask, torch.cat(node_rows), torch.cat(node_offsets),
        torch.tensor(roots),
    ]
    if branching:
        host += [
            torch.tensor([batch_indices[k] for k in branching]),
            torch.cat([rows[k] for k in branching]),
            torch.tensor([0, *itertools.accumulate(lengths)]),
            torch.cat([masks[k][:, : max(lengths)] for k in branching]),
        ]
    moved = packed_to_device(host, device)
    indices, tokens, parents, num_nodes, ancestors_d, query_rows, query_start_loc, query_mask, n_rows, n_offsets = moved[:10]
    attention = None
    if branching:
        b_indices, b_rows, b_starts, b_mask = moved[11:]
        attention = AttentionRows(
            batch_indices=b_indices,
            query_rows=b_rows,
            query_start_loc=b_starts.to(torch.int32),
            query_mask=b_mask.bool(),
            max_query_len=max(lengths),
        )
    return TreeStep(
        batch_indices=indices,
        trees=trees,
        tree_batch=TreeBatch(tokens, parents, num_nodes),
        ancestors=ancestors_d.bool(),
        query_rows=query_rows,
        query_start_loc=query_start_loc.to(torch.int32),
        query_mask=query_mask.bool(),
        host_batch_indices=list(batch_indices),
        host_first_rows=list(query_starts),
        host_root_rows=roots,
        node_rows=n_rows,
        node_offsets=n_offsets,
        root_rows=moved[10],
        host_query_mask=host_query_mask,
        attention=attention,
    )


def build_uniform_step(
    slots: list[int], trees: list[DraftTree], rows: int, buffers: TreeBuffers, device: torch.device,
) -> TreeStep:
    """Lay out a uniform step (every request of the batch ``rows`` query
    rows: root, its tree's nodes, then padding; ``step_widths``) from the
    persistent tree buffers: the trees (of batch rows ``slots``) travel in
    one pinned, non-blocking copy, and every row index, position offset and
    mask is derived from them on the device, in operations whose count
    depends on neither the batch nor the width. The same layout as
    :func:`build_step` gives such a step, at the step's width."""
    width = rows - 1
    index = buffers.write(to_device(buffers.host_rows(slots, trees), torch.long, device))
    tree = buffers.read(index, width)
    base = index * rows  # each request's first row, its root's
    nodes = torch.arange(width, device=base.device)
    host_first_rows = [slot * rows for slot in slots]
    return TreeStep(
        batch_indices=index,
        trees=trees,
        tree_batch=tree.batch,
        ancestors=tree.ancestors,
        query_rows=(base.unsqueeze(1) + torch.arange(rows, device=base.device)).flatten(),
        query_start_loc=torch.arange(len(trees) + 1, dtype=torch.int32, device=base.device) * rows,
        query_mask=row_visibility(tree).flatten(0, 1),
        host_batch_indices=list(slots),
        host_first_rows=host_first_rows,
        host_root_rows=host_first_rows,
        node_rows=(base.unsqueeze(1) + 1 + nodes).flatten(),
        node_offsets=torch.where(tree.valid(), tree.depth - 1 - nodes, 0).flatten(),
        root_rows=base,
    )
