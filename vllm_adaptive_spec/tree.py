"""Draft trees: one request's tree, and a batch of them as padded tensors.

Layout (docs/algorithms.md section 0): nodes are flattened breadth-first, every
parent before its children; a node's parent is the index of another node, or
-1 for a child of the root (the last committed token). Siblings carry distinct
tokens. Verification runs over ``1 + n`` rows per request: row 0 is the root,
row ``i + 1`` is node ``i``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
        p = self.path_probabilities()
        return self.subset(sorted(sorted(range(len(p)), key=lambda i: (-p[i], i))[:n]))

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
        width = max([len(t) for t in trees] + [0]) if width is None else width
        tokens = torch.full((len(trees), width), -1, dtype=torch.long)
        parents = torch.full((len(trees), width), ROOT, dtype=torch.long)
        for b, tree in enumerate(trees):
            n = len(tree)
            tokens[b, :n] = torch.tensor(tree.tokens, dtype=torch.long)
            parents[b, :n] = torch.tensor(tree.parents, dtype=torch.long)
        num_nodes = torch.tensor([len(t) for t in trees], dtype=torch.long)
        return TreeBatch(tokens.to(device), parents.to(device), num_nodes.to(device))

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
