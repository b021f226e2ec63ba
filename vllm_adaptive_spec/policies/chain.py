"""The chain baseline (ALGORITHMS.md section 2)."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.growth import Layer
from vllm_adaptive_spec.policies.base import TreePolicy


class ChainPolicy(TreePolicy):
    """The top-1 child at every depth, ``D = N``."""

    name = "chain"

    def select(self, layer: Layer) -> torch.Tensor:
        chosen = torch.zeros_like(layer.candidates.q, dtype=torch.bool)
        chosen[:, 0, 0] = layer.size < layer.budget
        return chosen
