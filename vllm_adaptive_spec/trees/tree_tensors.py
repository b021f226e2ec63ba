"""A step's trees as fixed-capacity device tensors, and the step's device math.

Issue 52's recipe for a tree step a CUDA graph can replay: every request
gets the same ``1 + W`` rows (root, then ``W`` node slots), requests that
draft fewer nodes get invalid padding slots that no row sees and none can
accept, and everything from the layout to the acceptance is a function of
tensors of those fixed shapes, with no host read and no data-dependent shape.
Adaptivity lives in which nodes fill the slots (:func:`select_within_width`)
and which ``W`` a step uses, not in ragged shapes.

Invariants of :class:`TreeTensors` (the layout of ``tree.TreeBatch``): a
request's valid nodes are its first ``num_nodes`` slots, breadth-first,
every parent before its children; invalid slots hold token ``-1`` and parent
``-1``, depth 0 and an all-false ancestor row.

Every function here is traced whole by ``torch.compile(fullgraph=True)`` at
fixed shapes and dispatches the same torch operations whatever the batch and
the width (``tests/test_tree_tensors.py``), which is what makes it
replayable from a graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_adaptive_spec.trees.tree import ROOT, DraftTree, HostTrees, TreeBatch
from vllm_adaptive_spec.trees.verify import PAD, Acceptance, accept, path_moves


class TreeTensors(NamedTuple):
    """``tokens``/``parents``/``depth`` [B, W] long, ``num_nodes`` [B] long,
    ``ancestors`` [B, W, W] bool (ancestor-or-self)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    ancestors: torch.Tensor

    @staticmethod
    def from_trees(trees: list[DraftTree], width: int) -> "TreeTensors":
        """The host side: trees (each at most ``width`` nodes) into the fixed
        layout, ready for one copy to the device."""
        host = HostTrees.of(trees, width)
        parts = (host.tokens, host.parents, host.depths(), host.num_nodes, host.ancestors)
        return TreeTensors(*(torch.from_numpy(x) for x in parts))

    @property
    def batch(self) -> TreeBatch:
        return TreeBatch(self.tokens, self.parents, self.num_nodes)

    def valid(self) -> torch.Tensor:
        return self.batch.valid()


class StepOutput(NamedTuple):
    """The device results of a verified tree step: ``acceptance``, vLLM's
    sampler output ``sampled`` [B, max_drafts + 1] (-1 padded), and the KV
    moves ``src_rows`` / ``dst_rows`` [B, W] (query rows, -1: no move)."""

    acceptance: Acceptance
    sampled: torch.Tensor
    src_rows: torch.Tensor
    dst_rows: torch.Tensor


def row_positions(base: torch.Tensor, tree: TreeTensors) -> torch.Tensor:
    """[B, 1 + W] positions of a request's rows: the root at ``base`` (its
    committed position), node ``i`` at ``base + depth_i``. Padding slots sit
    at ``base`` (any position works: no row sees them)."""
    return base.unsqueeze(1) + torch.nn.functional.pad(tree.depth, (1, 0))


def row_visibility(tree: TreeTensors) -> torch.Tensor:
    """[B, 1 + W, 1 + W] which of its request's rows each row sees: every
    row the root, a node its ancestors and itself; a padding row sees only
    the root (so its softmax is defined), and no row sees a padding row."""
    batch, width = tree.tokens.shape
    seen = torch.nn.functional.pad(tree.ancestors, (1, 0, 1, 0))
    root = torch.zeros(1 + width, dtype=torch.bool, device=seen.device)
    root[0] = True
    return seen | root


def greedy_targets(logits: torch.Tensor, batch: int) -> torch.Tensor:
    """[B, 1 + W] each row's argmax (the first index on ties, as vLLM's greedy sampler)."""
    return logits.argmax(dim=-1).view(batch, -1)


def sampled_targets(probs: torch.Tensor, noise: torch.Tensor, batch: int) -> torch.Tensor:
    """[B, 1 + W] one sample per row by the exponential race (``verify.sample_with_noise``)."""
    return (probs / noise).argmax(dim=-1).view(batch, -1)


def verify_step(tree: TreeTensors, targets: torch.Tensor, first_rows: torch.Tensor, max_drafts: int) -> StepOutput:
    """Accept every request's path given each row's target token
    (``targets`` [B, 1 + W]), lay the result out as vLLM's sampler output of
    ``max_drafts + 1`` columns, and find the KV moves that put each accepted
    path right after its root (``first_rows`` [B]: each request's first node
    row in the step)."""
    acceptance = accept(tree.batch, targets, tree.ancestors)
    width = tree.tokens.shape[1]
    if max_drafts >= width:
        sampled = torch.nn.functional.pad(acceptance.output_tokens, (0, max_drafts - width), value=PAD)
    else:
        sampled = acceptance.output_tokens[:, : max_drafts + 1]
    src_rows, dst_rows = path_moves(acceptance, first_rows)
    return StepOutput(acceptance, sampled, src_rows, dst_rows)


def select_within_width(
    tokens: torch.Tensor, parents: torch.Tensor, path_p: torch.Tensor, num_nodes: torch.Tensor,
    ancestors: torch.Tensor, width: int,
) -> TreeTensors:
    """The ``width`` candidates of highest path probability per request
    (``tokens``/``parents``/``path_p`` [B, C], the first ``num_nodes`` valid,
    breadth-first; ``ancestors`` [B, C, C]), kept in their breadth-first
    order: one sort and one cumulative sum, as ``DraftTree.keep_best`` on
    each tree (earlier node first on ties). The kept set is closed under
    ancestors because ``p`` never rises along a path and a parent comes
    before its children."""
    batch, capacity = tokens.shape
    device = tokens.device
    slots = torch.arange(capacity, device=device).expand(batch, capacity)
    valid = slots < num_nodes.unsqueeze(1)
    score = torch.where(valid, path_p, -1.0)
    order = torch.sort(score, dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, slots)
    keep = valid & (rank < width)
    new_index = torch.cumsum(keep.long(), dim=1) - 1
    # Kept candidate -> its new slot; the rest to a spill column cut off below.
    target = torch.where(keep, new_index, width)
    old_of_new = torch.full((batch, width + 1), capacity, dtype=torch.long, device=device)
    old_of_new.scatter_(1, target, slots)
    old_of_new = old_of_new[:, :width]
    kept_count = keep.sum(1)
    filled = torch.arange(width, device=device).unsqueeze(0) < kept_count.unsqueeze(1)
    source = old_of_new.clamp(max=capacity - 1)
    old_parent = parents.gather(1, source)
    remapped = new_index.gather(1, old_parent.clamp(min=0))
    new_parents = torch.where(filled & (old_parent >= 0), remapped, ROOT)
    new_tokens = torch.where(filled, tokens.gather(1, source), PAD)
    rows = ancestors.gather(1, source.unsqueeze(2).expand(batch, width, capacity))
    new_ancestors = rows.gather(2, source.unsqueeze(1).expand(batch, width, width))
    new_ancestors = new_ancestors & filled.unsqueeze(1) & filled.unsqueeze(2)
    return TreeTensors(new_tokens, new_parents, new_ancestors.sum(-1), kept_count, new_ancestors)
