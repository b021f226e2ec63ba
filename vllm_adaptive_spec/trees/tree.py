"""Draft trees: one request's tree, and a batch of them as padded tensors.

Layout (docs/algorithms.md section 0): nodes are flattened breadth-first, every
parent before its children; a node's parent is the index of another node, or
-1 for a child of the root (the last committed token). Siblings carry distinct
tokens. Verification runs over ``1 + n`` rows per request: row 0 is the root,
row ``i + 1`` is node ``i``.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import torch

ROOT = -1


@dataclass
class DraftTree:
    """One request's tree: ``tokens[i]`` drawn from the distribution after
    ``parents[i]`` with draft probability ``q[i]``; ``parent_entropy[i]``:
    that distribution's top-M entropy where the drafter computed it (C2T's
    feature; empty otherwise, and not part of a tree's identity)."""

    tokens: list[int] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    q: list[float] = field(default_factory=list)
    parent_entropy: list[float] = field(default_factory=list, compare=False)

    def __len__(self) -> int:
        return len(self.tokens)

    def depths(self) -> list[int]:
        depth: list[int] = []
        for parent in self.parents:
            depth.append(1 if parent == ROOT else depth[parent] + 1)
        return depth

    def prefix(self, n: int) -> "DraftTree":
        """The first ``n`` nodes: a valid tree, since parents come first."""
        return DraftTree(self.tokens[:n], self.parents[:n], self.q[:n], self.parent_entropy[:n])

    def path_probabilities(self) -> list[float]:
        """``p`` of every node: the product of ``q`` along its path."""
        p: list[float] = []
        for parent, q in zip(self.parents, self.q):
            p.append(q if parent == ROOT else p[parent] * q)
        return p

    def keep_best(self, n: int) -> "DraftTree":
        """The ``n`` nodes of highest path probability (earlier node first on
        ties, so the set is closed under ancestors), breadth-first."""
        if n >= len(self):
            return self
        if n <= 0:
            return DraftTree()
        p = self.path_probabilities()
        return self.subset(sorted(sorted(range(len(p)), key=lambda i: (-p[i], i))[:n]))

    def at_least(self, floor: float) -> "DraftTree":
        """The nodes whose path probability is at least ``floor`` (closed
        under ancestors, as ``p`` never rises along a path); the tree itself
        when that is all of them."""
        kept = [i for i, p in enumerate(self.path_probabilities()) if p >= floor]
        return self if len(kept) == len(self) else self.subset(kept)

    def subset(self, kept: list[int]) -> "DraftTree":
        """The nodes ``kept`` (ascending, closed under ancestors), breadth-first."""
        index = {old: new for new, old in enumerate(kept)}
        return DraftTree(
            [self.tokens[i] for i in kept],
            [ROOT if self.parents[i] == ROOT else index[self.parents[i]] for i in kept],
            [self.q[i] for i in kept],
            [self.parent_entropy[i] for i in kept] if self.parent_entropy else [],
        )

    def main_path(self) -> "DraftTree":
        """The chain from the root that takes the most likely child at every
        depth (earlier node first on ties)."""
        p = self.path_probabilities()
        path, parent = [], ROOT
        while True:
            children = [i for i, up in enumerate(self.parents) if up == parent]
            if not children:
                break
            parent = max(children, key=lambda i: (p[i], -i))
            path.append(parent)
        return self.subset(path)

    def branches(self) -> bool:
        return self.parents != list(range(-1, len(self) - 1))

    @staticmethod
    def chain(tokens: list[int]) -> "DraftTree":
        return DraftTree(list(tokens), list(range(-1, len(tokens) - 1)), [1.0] * len(tokens))

    def validate(self) -> None:
        """Raise ValueError unless the tree is breadth-first with distinct siblings."""
        if not len(self.tokens) == len(self.parents) == len(self.q):
            raise ValueError("tokens, parents and q differ in length")
        seen: set[tuple[int, int]] = set()
        for i, (token, parent) in enumerate(zip(self.tokens, self.parents)):
            if not ROOT <= parent < i:
                raise ValueError(f"node {i} has parent {parent}: parents must come first")
            if (parent, token) in seen:
                raise ValueError(f"node {i} repeats token {token} among its siblings")
            seen.add((parent, token))
        depths = self.depths()
        if depths != sorted(depths):
            raise ValueError("nodes are not in breadth-first order")


@dataclass
class TreeBatch:
    """A batch of trees padded to width ``W``: ``tokens``/``parents`` [B, W]
    (padding: token -1, parent -1), ``num_nodes`` [B]."""

    tokens: torch.Tensor
    parents: torch.Tensor
    num_nodes: torch.Tensor

    @staticmethod
    def from_trees(trees: list[DraftTree], width: int | None = None, device=None) -> "TreeBatch":
        return HostTrees.of(trees, width).batch(device)

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    def valid(self) -> torch.Tensor:
        """[B, W] bool: which slots hold a node."""
        slots = torch.arange(self.width, device=self.tokens.device)
        return slots.unsqueeze(0) < self.num_nodes.unsqueeze(1)

    def ancestor_mask(self) -> torch.Tensor:
        """[B, W, W] bool: ``mask[b, i, j]`` iff node j is node i or one of its
        ancestors. One gather per tree level (pointer chasing), batched."""
        batch, width = self.tokens.shape
        valid = self.valid()
        mask = torch.zeros(batch, width, width, dtype=torch.bool, device=self.tokens.device)
        rows = torch.arange(width, device=self.tokens.device).expand(batch, width)
        current = torch.where(valid, rows, torch.full_like(rows, ROOT))
        while bool((current != ROOT).any()):
            live = current != ROOT
            mask |= torch.nn.functional.one_hot(current.clamp(min=0), width).bool() & live.unsqueeze(2)
            current = torch.where(live, self.parents.gather(1, current.clamp(min=0)), current)
        return mask

    def row_mask(self, ancestors: torch.Tensor | None = None) -> torch.Tensor:
        """[B, 1 + W, 1 + W] bool over verification rows (row 0 = root): every
        row sees the root, itself and its ancestors (``ancestors``: a
        precomputed :meth:`ancestor_mask`)."""
        batch, width = self.tokens.shape
        mask = torch.zeros(batch, width + 1, width + 1, dtype=torch.bool, device=self.tokens.device)
        mask[:, :, 0] = True
        mask[:, 1:, 1:] = self.ancestor_mask() if ancestors is None else ancestors
        return mask


class HostTrees(NamedTuple):
    """A step's trees on the host, padded to width ``W`` as numpy arrays (the
    layout of :class:`TreeBatch`): ``tokens``/``parents`` [B, W] int64,
    ``num_nodes`` [B], ``ancestors`` [B, W, W] bool (ancestor-or-self):
    what a uniform step's persistent buffers are written from
    (``tree_buffers``) and :meth:`TreeBatch.from_trees` builds. A ragged
    step's layout is built in plain lists (``row_layout``)."""

    tokens: np.ndarray
    parents: np.ndarray
    num_nodes: np.ndarray
    ancestors: np.ndarray

    @staticmethod
    def of(trees: list[DraftTree], width: int | None = None) -> "HostTrees":
        """The trees (each at most ``width`` nodes; default: the largest) in
        one fill per array, not one per tree."""
        counts = np.fromiter((len(tree) for tree in trees), dtype=np.int64, count=len(trees))
        width = int(counts.max(initial=0)) if width is None else width
        valid = np.arange(width) < counts[:, None]
        total = int(counts.sum())
        tokens = np.full((len(trees), width), -1, dtype=np.int64)
        parents = np.full((len(trees), width), ROOT, dtype=np.int64)
        tokens[valid] = np.fromiter(itertools.chain.from_iterable(t.tokens for t in trees), np.int64, total)
        parents[valid] = np.fromiter(itertools.chain.from_iterable(t.parents for t in trees), np.int64, total)
        return HostTrees(tokens, parents, counts, ancestors_of(parents, valid))

    def depths(self) -> np.ndarray:
        """[B, W] each node's depth (1 for the root's children; 0 padding)."""
        return self.ancestors.sum(-1)

    def batch(self, device=None) -> TreeBatch:
        """As torch tensors (on ``device``; on the host they share the arrays)."""
        return TreeBatch(*(torch.from_numpy(x).to(device) for x in (self.tokens, self.parents, self.num_nodes)))


def ancestors_of(parents: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """[B, W, W] ancestor-or-self masks of breadth-first trees (``parents``
    [B, W], ``valid`` [B, W]). A chain's mask is its lower triangle (most of
    a retrieval drafter's trees: one continuation matched), so only the
    branching trees follow every node's chain to the root, for all of them
    at once, one round a tree level."""
    width = parents.shape[1]
    nodes = np.arange(width)
    mask = (nodes[:, None] >= nodes[None, :]) & valid[:, :, None]
    branching = np.flatnonzero(((parents != nodes - 1) & valid).any(1))
    if branching.size:
        mask[branching] = _followed_to_root(parents[branching], valid[branching])
    return mask


def _followed_to_root(parents: np.ndarray, valid: np.ndarray) -> np.ndarray:
    """:func:`ancestors_of` by pointer chasing, for trees of any shape."""
    batch, width = parents.shape
    mask = np.zeros((batch, width, width), dtype=bool)
    trees, nodes = np.indices((batch, width))
    current = np.where(valid, nodes, ROOT)
    live = current != ROOT
    while live.any():
        mask[trees[live], nodes[live], current[live]] = True
        current = np.where(live, np.take_along_axis(parents, np.maximum(current, 0), 1), ROOT)
        live = current != ROOT
    return mask
