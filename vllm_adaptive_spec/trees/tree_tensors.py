"""A step's trees as fixed-capacity device tensors.

The recipe for a tree step a CUDA graph can replay: every request gets the
same ``1 + W`` rows (root, then ``W`` node slots), requests that draft
fewer nodes get invalid padding slots that no row sees and none can accept,
and everything from the layout to the acceptance is a function of tensors
of those fixed shapes, with no host read and no data-dependent shape.
Adaptivity lives in which nodes fill the slots and which ``W`` a step uses
(the load budget's choice), not in ragged shapes.

Invariants of :class:`TreeTensors` (the layout of ``tree.TreeBatch``): a
request's valid nodes are its first ``num_nodes`` slots, breadth-first,
every parent before its children; invalid slots hold token ``-1`` and parent
``-1``, depth 0 and an all-false ancestor row.

What a uniform step derives from them (``tree_step.uniform_layout``, then the
verifier's ``verify.accept`` and the KV moves) is traced whole by
``torch.compile(fullgraph=True)`` at fixed shapes and dispatches the same
torch operations whatever the batch and the width
(``tests/test_tree_tensors.py``), which is what makes it replayable from a graph.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from vllm_adaptive_spec.trees.tree import TreeBatch


class TreeTensors(NamedTuple):
    """``tokens``/``parents``/``depth`` [B, W] long, ``num_nodes`` [B] long,
    ``ancestors`` [B, W, W] bool (ancestor-or-self)."""

    tokens: torch.Tensor
    parents: torch.Tensor
    depth: torch.Tensor
    num_nodes: torch.Tensor
    ancestors: torch.Tensor

    @property
    def batch(self) -> TreeBatch:
        return TreeBatch(self.tokens, self.parents, self.num_nodes)

    def valid(self) -> torch.Tensor:
        return self.batch.valid()


def row_visibility(tree: TreeTensors) -> torch.Tensor:
    """[B, 1 + W, 1 + W] which of its request's rows each row sees: every
    row the root, a node its ancestors and itself; a padding row sees only
    the root (so its softmax is defined), and no row sees a padding row."""
    batch, width = tree.tokens.shape
    seen = torch.nn.functional.pad(tree.ancestors, (1, 0, 1, 0))
    root = torch.zeros(1 + width, dtype=torch.bool, device=seen.device)
    root[0] = True
    return seen | root
