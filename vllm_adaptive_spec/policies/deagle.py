"""DEAGLE: the eagle2 expansion with a voting early stop on depth (seed 004; docs/algorithms.md section 5)."""

from __future__ import annotations

import torch

from vllm_adaptive_spec.config_schema import fraction, integer
from vllm_adaptive_spec.policies.eagle2 import Eagle2Policy
from vllm_adaptive_spec.trees.candidates import Layer


class DeaglePolicy(Eagle2Policy):
    """Each layer as eagle2 (the ``K`` best of the frontier's children), up to
    ``D`` layers; after depth ``d`` a request stops growing when at least two
    of three signals vote for it:

    * ``S_d < tau_S``, with ``S_d`` the sum of the layer's kept ``p``;
    * ``hits >= 2``, with ``hits`` counting the depths ``d >= 2`` where
      ``rho_d = S_d / S_{d-1} < tau_rho`` (the reading of docs/algorithms.md: the
      paper's Eq. 25 has the ratio upside down);
    * ``d >= ceil(E_d)``, with ``E_d`` the sum of ``p`` over every node kept
      so far (the expected accepted length if acceptances were independent).

    The stopped request keeps its layer; the ``N`` best nodes are kept at the
    end as in eagle2. What it saves is draft passes at large ``D``."""

    name = "deagle"
    PARAMS = {
        "top_k": integer(10, 1, 64),
        "depth": integer(18, 1, 64),
        "tau_s": fraction(0.15),
        "tau_rho": fraction(0.6),
    }

    def __init__(self, top_k: int = 10, depth: int = 18, tau_s: float = 0.15, tau_rho: float = 0.6) -> None:
        super().__init__(top_k, depth)
        self.tau_s, self.tau_rho = tau_s, tau_rho
        self._last_sum = self._hits = self._expected = None

    def select(self, layer: Layer) -> torch.Tensor:
        chosen = super().select(layer)
        layer_sum = torch.where(chosen, layer.p, 0.0).flatten(1).sum(1)
        if layer.depth == 1:
            self._hits = torch.zeros_like(layer_sum, dtype=torch.long)
            self._expected = torch.zeros_like(layer_sum)
        else:
            falling = layer_sum < self.tau_rho * self._last_sum
            self._hits = self._hits + falling.long()
        self._last_sum = layer_sum
        self._expected = self._expected + layer_sum
        votes = (
            (layer_sum < self.tau_s).long()
            + (self._hits >= 2).long()
            + (layer.depth >= torch.ceil(self._expected)).long()
        )
        layer.stop |= votes >= 2
        return chosen
