"""A step's trees over their requests' query rows, in plain Python.

A request's tree occupies ``1 + n`` of its query rows (root, then nodes),
followed by ``padding`` rows (a uniform step's ``-1`` drafts,
``uniform_widths``), which see the rows up to the root and which no row
sees; earlier rows (if any) are causal, and every tree row sees them all.

Decision (lists, not numpy): the layout is built on the host every step,
right after the previous step's forward, where the first call of each
numpy or torch operation costs tens of microseconds (the forward has left
the host's caches cold) while its arithmetic, a few hundred elements, costs
next to nothing. The vectorised numpy layout (about sixty operations) took
0.41 ms a verified step at batch 1 on a 2-core Intel Xeon, these lists 0.14
(the step's whole layout at batch 8: 0.29 and 0.14 ms a step). The step's
tensors are made from them in one conversion (``step/transfer.packed_to_device``).
"""

from __future__ import annotations

from typing import NamedTuple

from vllm_adaptive_spec.trees.tree import ROOT, DraftTree


class RowLayout(NamedTuple):
    """The step's layout as flat row-major lists: ``tokens`` / ``parents``
    [B, N] (N: the most nodes of one tree; padding -1), ``num_nodes`` [B],
    ``ancestors`` [B, N, N] (ancestor-or-self, 0 / 1), ``query_rows`` [T],
    ``query_start_loc`` [B + 1], ``query_mask`` [T, W] (W: the most rows of
    one request; which of its request's rows a row sees, 0 / 1),
    ``node_rows`` / ``node_offsets`` (each node's query row and its depth
    position's offset from the row's sequential one), ``roots`` [B] (each
    tree's root row) and ``branching``: the trees that are not a chain."""

    tokens: list[int]
    parents: list[int]
    num_nodes: list[int]
    ancestors: list[int]
    query_rows: list[int]
    query_start_loc: list[int]
    query_mask: list[int]
    node_rows: list[int]
    node_offsets: list[int]
    roots: list[int]
    branching: list[int]
    nodes: int
    width: int


def lay_out_rows(trees: list[DraftTree], starts: list[int], lengths: list[int], paddings: list[int]) -> RowLayout:
    """The layout of ``trees``, request ``k``'s ``lengths[k]`` query rows
    from row ``starts[k]``, its last ``paddings[k]`` rows padding."""
    nodes, width = max((len(tree) for tree in trees), default=0), max(lengths, default=0)
    out = RowLayout([], [], [], [], [], [0], [], [], [], [], [], nodes, width)
    for k, (tree, start, length, padding) in enumerate(zip(trees, starts, lengths, paddings)):
        n = len(tree)
        before = length - 1 - n - padding  # rows ahead of the root
        ancestors = _ancestors(tree.parents, nodes)
        out.tokens.extend(tree.tokens + [-1] * (nodes - n))
        out.parents.extend(tree.parents + [ROOT] * (nodes - n))
        out.num_nodes.append(n)
        for row in ancestors:
            out.ancestors.extend(row)
        out.ancestors.extend([0] * (nodes * (nodes - n)))
        out.query_rows.extend(range(start, start + length))
        out.query_start_loc.append(out.query_start_loc[-1] + length)
        out.query_mask.extend(_row_mask(ancestors, before, n, length, width))
        out.node_rows.extend(range(start + before + 1, start + before + 1 + n))
        out.node_offsets.extend(depth - 1 - node for node, depth in enumerate(tree.depths()))
        out.roots.append(start + before)
        if tree.branches():
            out.branching.append(k)
    return out


def _ancestors(parents: list[int], nodes: int) -> list[list[int]]:
    """Each node's ancestor-or-self row (``nodes`` wide, 0 / 1); a parent
    comes before its children."""
    rows: list[list[int]] = []
    for node, parent in enumerate(parents):
        row = [0] * nodes if parent == ROOT else rows[parent][:]
        row[node] = 1
        rows.append(row)
    return rows


def _row_mask(ancestors: list[list[int]], before: int, n: int, length: int, width: int) -> list[int]:
    """[length, width] which of its request's rows each row sees: causal
    up to the root; the root sees the rows up to itself, a node those and
    its ancestors and itself; padding rows see the rows up to the root."""
    mask: list[int] = []
    for row in range(before):
        mask.extend([1] * (row + 1) + [0] * (width - row - 1))
    mask.extend([1] * (before + 1) + [0] * (width - before - 1))  # the root
    for node in range(n):
        mask.extend([1] * (before + 1) + ancestors[node][:n] + [0] * (width - before - 1 - n))
    for _ in range(length - before - 1 - n):
        mask.extend([1] * (before + 1) + [0] * (width - before - 1))
    return mask
