"""The retrieval tree (docs/algorithms.md section 7)."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.config_schema import fraction
from vllm_adaptive_spec.policies.base import TreePolicy, top_by_path_probability
from vllm_adaptive_spec.trees.candidates import Layer
from vllm_adaptive_spec.trees.tree import DraftTree


class RetrievalPolicy(TreePolicy):
    """Take every retrieved continuation whose path probability ``p`` is at
    least ``min_p``, then prune the least likely subtrees (lowest ``p``)
    until the tree holds ``N`` nodes at most.

    Decision: ``min_p`` (not in the paper) drafts only what the evidence
    supports; with the retrieval drafter's calibrated ``q``, ``p`` is the
    node's chance of acceptance, so a node below ``min_p`` is expected to
    add less than ``min_p`` tokens for the cost of a verified row."""

    name = "retrieval"
    PARAMS = {"min_p": fraction(0.05)}
    grows_past_max_nodes = True
    chooses_trees = chooses_tensors = True
    fanout = 0  # the retrieval drafter's trie decides

    def __init__(self, min_p: float = 0.05) -> None:
        self.min_p = min_p

    @property
    def floor(self) -> float:
        return self.min_p

    def depth_limit(self, max_nodes: int) -> int:
        return 1 << 30  # the drafter's max_depth decides

    def max_fed_nodes(self, max_nodes: int) -> int:
        return 0

    def select(self, layer: Layer) -> torch.Tensor:
        return (layer.candidates.q > 0) & (layer.p >= self.min_p)

    def finish(self, p: torch.Tensor, valid: torch.Tensor, max_nodes: torch.Tensor) -> torch.Tensor:
        return top_by_path_probability(p, valid, max_nodes)

    def choose(self, tree: DraftTree, max_nodes: int) -> DraftTree:
        """From a whole candidate tree: the nodes with ``p >= min_p`` (closed
        under ancestors, as ``p`` never rises along a path), then the
        ``max_nodes`` of highest ``p`` (ties: the earlier node)."""
        return tree.at_least(self.min_p).keep_best(max_nodes)

    def choose_tensors(self, trees, max_nodes: torch.Tensor, width: int):
        """:meth:`choose` for a batch of whole candidate trees on their device
        (``retrieval_tensors.CandidateTrees`` grown at ``floor >= min_p``, so
        ``min_p`` is already applied): each one's ``max_nodes`` [B] best nodes in
        ``width`` slots."""
        return trees.best(max_nodes, width)
