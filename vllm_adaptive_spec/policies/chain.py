"""The chain baseline (docs/algorithms.md section 2)."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.policies.base import TreePolicy
from vllm_adaptive_spec.trees.candidates import Layer
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree


class ChainPolicy(TreePolicy):
    """The top-1 child at every depth, ``D = N``."""

    name = "chain"
    chooses_trees = True

    def layer_width(self, max_nodes: int) -> int:
        return 1

    def select(self, layer: Layer) -> torch.Tensor:
        chosen = torch.zeros_like(layer.candidates.q, dtype=torch.bool)
        chosen[:, 0, 0] = layer.size < layer.max_nodes
        return chosen

    def choose(self, tree: DraftTree, max_nodes: int) -> DraftTree:
        """From a whole candidate tree: the first child at every depth
        (breadth-first, a node's first child is the earliest node under it)."""
        path, parent = [], ROOT
        for i, up in enumerate(tree.parents):
            if len(path) == max_nodes:
                break
            if up == parent:
                path.append(i)
                parent = i
        return tree.subset(path)
