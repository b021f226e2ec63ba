"""C2T: the classifier-pruned tree (seed 002; docs/algorithms.md section 4)."""

from __future__ import annotations

import torch

from kernels.c2t_gate import c2t_gate
from vllm_adaptive_spec.classifier import FILE_NAME, C2TClassifier
from vllm_adaptive_spec.config_schema import Param, fraction, integer
from vllm_adaptive_spec.policies.base import TreePolicy, top_by_path_probability
from vllm_adaptive_spec.trees.candidates import Layer


class C2TPolicy(TreePolicy):
    """Layer by layer, a small classifier (:mod:`vllm_adaptive_spec.classifier`)
    scores every candidate (the top-``K`` children of each frontier node)
    from its path probability, its parent's top-M entropy and its depth; the
    candidates scoring at least ``beta`` survive and the ``K`` most confident
    of the layer become the frontier; growth stops at ``max_depth`` or when
    no candidate survives; a tree over ``N`` nodes keeps its ``N`` most
    confident, closed under ancestors. Features, network, threshold and cut
    are one fused operation for the batch (``kernels.c2t_gate``).

    Decision: a node's rank in the final cut is the smallest confidence on
    its path (its own and its ancestors'), so the top-``N`` by rank is closed
    under ancestors (a parent ranks at least as high and comes first on ties).
    ``classifier``: a classifier file; the default is ``c2t_classifier.json``
    in the draft model's directory (resolved when the config is parsed); its
    ``top_m`` sets the entropy the drafter computes."""

    name = "c2t"
    PARAMS = {
        "top_k": integer(10, 1, 64),
        "max_depth": integer(10, 1, 64),
        "beta": fraction(0.5),
        "classifier": Param(
            str, "", f"the path of a C2T classifier file, or '' for the draft model's {FILE_NAME}",
            lambda v: True,
        ),
    }
    grows_past_max_nodes = True

    def __init__(self, top_k: int = 10, max_depth: int = 10, beta: float = 0.5, classifier: str = "") -> None:
        if not classifier:
            raise ValueError(f"'classifier' must name a C2T classifier file (default: the draft model's {FILE_NAME})")
        try:
            self.classifier = C2TClassifier.load(classifier)
        except ValueError as error:
            raise ValueError(f"'classifier': {error}") from None
        self.top_k, self.max_depth, self.beta = top_k, max_depth, beta
        self.fanout = top_k
        self.entropy_top_m = self.classifier.top_m
        self._weights: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def depth_limit(self, max_nodes: int) -> int:
        return self.max_depth

    def max_fed_nodes(self, max_nodes: int) -> int:
        return self.top_k * (self.max_depth - 1)

    def weights(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._weights:
            c = self.classifier.to(device)
            self._weights[device] = (c.w1, c.b1, c.w2, c.b2)
        return self._weights[device]

    def layer_width(self, max_nodes: int) -> int:
        return self.top_k

    def select(self, layer: Layer) -> torch.Tensor:
        candidates, p = layer.candidates, layer.p
        if candidates.entropy is None:
            raise RuntimeError("the c2t policy needs the drafter's top-M entropy (a model drafter)")
        exists = (candidates.q > 0) & (p > 0)
        chosen, confidence = c2t_gate(
            p, candidates.entropy, exists, layer.depth, *self.weights(p.device), self.beta, self.top_k
        )
        layer.score = torch.minimum(confidence, layer.parent_score.unsqueeze(-1))
        return chosen

    def finish(self, score: torch.Tensor, valid: torch.Tensor, max_nodes: torch.Tensor) -> torch.Tensor:
        return top_by_path_probability(score, valid, max_nodes)
