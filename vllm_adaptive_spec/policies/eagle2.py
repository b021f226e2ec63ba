"""The EAGLE-2/3 dynamic tree, the seeds' common baseline (docs/algorithms.md section 2)."""

from __future__ import annotations

import torch

from kernels.draft_distribution import MAX_M
from vllm_adaptive_spec.config_schema import integer
from vllm_adaptive_spec.policies.base import TreePolicy, best_of_layer, top_by_path_probability
from vllm_adaptive_spec.trees.candidates import Layer


class Eagle2Policy(TreePolicy):
    """The root's top-``K`` children, then at each depth the ``K`` best (by
    path probability ``p``) of the frontier's ``K * K`` top-``K`` children,
    for ``D`` layers; at the end the ``N`` nodes of highest ``p`` are kept
    (ancestor-closed, as ``p`` only falls along a path). ``entropy_top_m``
    > 0 has the drafter record each node's parent top-M entropy (the rows
    ``vllm-adaptive-spec c2t-collect`` trains C2T's classifier on)."""

    name = "eagle2"
    PARAMS = {
        "top_k": integer(10, 1, 64),
        "depth": integer(8, 1, 64),
        "entropy_top_m": integer(0, 0, MAX_M),
    }
    grows_past_max_nodes = True

    def __init__(self, top_k: int = 10, depth: int = 8, entropy_top_m: int = 0) -> None:
        self.top_k = top_k
        self.depth = depth
        self.fanout = top_k
        self.entropy_top_m = entropy_top_m

    def depth_limit(self, max_nodes: int) -> int:
        return self.depth

    def max_fed_nodes(self, max_nodes: int) -> int:
        return self.top_k * (self.depth - 1)

    def layer_width(self, max_nodes: int) -> int:
        return self.top_k

    def select(self, layer: Layer) -> torch.Tensor:
        width = torch.full_like(layer.max_nodes, self.top_k)
        return best_of_layer(layer, layer.p > 0, width)

    def finish(self, p: torch.Tensor, valid: torch.Tensor, max_nodes: torch.Tensor) -> torch.Tensor:
        return top_by_path_probability(p, valid, max_nodes)
