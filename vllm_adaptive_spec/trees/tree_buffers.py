"""A step's trees in persistent device buffers, with ancestor bitmasks.

A uniform tree step (``uniform_widths``) reads its trees from
tensors allocated once, one row per slot of vLLM's input batch and
``capacity`` node slots a row: ``tokens``, ``parents``, ``depth``,
``num_nodes`` and, per node, its ancestor-or-self set as a bitmask (bit
``j`` of word ``j // 64``: node ``j`` is an ancestor or the node itself).
A bitmask row is ``capacity / 64`` words where a boolean mask would be
``capacity`` bytes, and it is what a device drafter writes as it grows a
node (its parent's bits and its own).

The host drafters' trees reach the buffers as one host tensor
(:meth:`TreeBuffers.host_rows`) that the adapter sends in one pinned,
non-blocking copy, scattered there (:meth:`TreeBuffers.write`); vLLM's reordering of requests is the one
index map ``slots`` (each tree's row in this step's batch). Everything the
step derives (visibility, positions, acceptance) comes from
:meth:`TreeBuffers.read` on the device, at the fixed shape of the step's
width, in operations whose count depends on neither the batch nor the width.
"""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaptive_spec.trees.tree import ROOT, DraftTree, HostTrees
from vllm_adaptive_spec.trees.tree_tensors import TreeTensors
from vllm_adaptive_spec.trees.verify import PAD

WORD_BITS = 64


def num_words(capacity: int) -> int:
    return max(1, -(-capacity // WORD_BITS))


def pack_bits(mask: torch.Tensor, words: int) -> torch.Tensor:
    """``[..., C]`` bool into ``[..., words]`` int64 bitmasks (bit 63 is the
    sign bit: the sum wraps as two's complement, which is the bit pattern)."""
    width = mask.shape[-1]
    padded = torch.nn.functional.pad(mask.to(torch.int64), (0, words * WORD_BITS - width))
    shifts = torch.arange(WORD_BITS, device=mask.device)
    return (padded.view(*mask.shape[:-1], words, WORD_BITS) << shifts).sum(-1)


def unpack_bits(bits: torch.Tensor, width: int) -> torch.Tensor:
    """``[..., words]`` int64 bitmasks into ``[..., width]`` bool."""
    shifts = torch.arange(WORD_BITS, device=bits.device)
    flat = ((bits.unsqueeze(-1) >> shifts) & 1).flatten(-2)
    return flat[..., :width].bool()


class TreeBuffers:
    """Persistent tree tensors for up to ``max_reqs`` requests of at most
    ``capacity`` nodes each, on ``device`` (layout: ``tree_tensors``)."""

    def __init__(self, max_reqs: int, capacity: int, device: torch.device) -> None:
        self.capacity, self.words = capacity, num_words(capacity)
        self.tokens = torch.full((max_reqs, capacity), PAD, dtype=torch.long, device=device)
        self.parents = torch.full((max_reqs, capacity), ROOT, dtype=torch.long, device=device)
        self.depth = torch.zeros(max_reqs, capacity, dtype=torch.long, device=device)
        self.num_nodes = torch.zeros(max_reqs, dtype=torch.long, device=device)
        self.bits = torch.zeros(max_reqs, capacity, self.words, dtype=torch.long, device=device)

    def host_rows(self, slots: list[int], trees: list[DraftTree]) -> torch.Tensor:
        """``[len(trees), 1 + C * (3 + words) + 1]`` int64 on the host: each
        tree's slot, then its tokens, parents, depths, node count and
        ancestor bitmasks, padded to the capacity (so that writing it leaves
        nothing of an earlier step in the row)."""
        host = HostTrees.of(trees, self.capacity)
        bits = pack_bits(torch.from_numpy(host.ancestors), self.words).flatten(1).numpy()
        return torch.from_numpy(np.concatenate([
            np.asarray(slots, dtype=np.int64)[:, None], host.tokens, host.parents, host.depths(),
            host.num_nodes[:, None], bits,
        ], axis=1))

    def write(self, rows: torch.Tensor) -> torch.Tensor:
        """Scatter :meth:`host_rows`, now on the buffers' device, into the
        buffers; returns the trees' slots there."""
        capacity = self.capacity
        index = rows[:, 0]
        parts = rows[:, 1:].split([capacity, capacity, capacity, 1, capacity * self.words], dim=1)
        for buffer, part in zip((self.tokens, self.parents, self.depth, self.num_nodes, self.bits), parts):
            buffer.index_copy_(0, index, part.reshape(-1, *buffer.shape[1:]))
        return index

    def read(self, slots: torch.Tensor, width: int) -> TreeTensors:
        """The trees of rows ``slots`` at ``width`` node slots (at most the
        capacity; a tree is never wider than its step's width)."""
        ancestors = unpack_bits(self.bits[slots, :width], width)
        return TreeTensors(self.tokens[slots, :width], self.parents[slots, :width], self.depth[slots, :width],
                           self.num_nodes[slots], ancestors)
