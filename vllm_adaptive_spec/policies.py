"""Tree policies: given the drafter's candidates for the frontier, choose the
next layer or stop (``select``), then trim the grown tree (``finish``).

Each policy declares its parameters (``PARAMS``) so the config can be checked
at startup, how deep it may grow (``depth_limit``), how many candidates per
node it looks at (``fanout``) and how many nodes a model drafter may run on
while growing one tree (``max_fed_nodes``, the draft KV scratch); later
policies (TALON, C2T, DEAGLE, DynaTree) plug in through the same methods.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch

from vllm_adaptive_spec.growth import Layer


@dataclass(frozen=True)
class Param:
    """A tunable setting: its type, default and the rule a value must obey."""

    kind: type
    default: Any
    rule: str
    check: Callable[[Any], bool]


def top_by_path_probability(p: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
    """Keep each request's ``budget`` nodes of highest path probability.

    Ties go to the earlier node. The kept set is closed under ancestors: a
    child's ``p`` never exceeds its parent's (``q <= 1``) and a parent comes
    first, so it always ranks before its children.
    """
    score = torch.where(valid, p, -1.0)
    order = torch.sort(-score, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(p.shape[1]).expand_as(order))
    return valid & (rank < budget.unsqueeze(1))


class ChainPolicy:
    """ALGORITHMS.md section 2: the top-1 child at every depth, ``D = N``."""

    name = "chain"
    PARAMS: dict[str, Param] = {}
    grows_past_budget = False
    fanout = 1

    def depth_limit(self, budget: int) -> int:
        return budget

    def max_fed_nodes(self, budget: int) -> int:
        """Nodes a model drafter runs on while growing one tree (its KV scratch)."""
        return budget - 1

    def select(self, layer: Layer) -> torch.Tensor:
        chosen = torch.zeros_like(layer.candidates.q, dtype=torch.bool)
        chosen[:, 0, 0] = layer.size < layer.budget
        return chosen

    def finish(self, p: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        return valid


class Eagle2Policy:
    """ALGORITHMS.md section 2, the EAGLE-2/3 dynamic tree: the root's top-``K``
    children, then at each depth the ``K`` best (by path probability ``p``) of
    the frontier's ``K * K`` top-``K`` children, for ``D`` layers; at the end
    the ``N`` nodes of highest ``p`` are kept (ancestor-closed, as ``p`` only
    falls along a path)."""

    name = "eagle2"
    PARAMS = {
        "top_k": Param(int, 10, "an integer from 1 to 64", lambda v: 1 <= v <= 64),
        "depth": Param(int, 8, "an integer from 1 to 64", lambda v: 1 <= v <= 64),
    }
    grows_past_budget = True

    def __init__(self, top_k: int = 10, depth: int = 8) -> None:
        self.top_k = top_k
        self.depth = depth
        self.fanout = top_k

    def depth_limit(self, budget: int) -> int:
        return self.depth

    def max_fed_nodes(self, budget: int) -> int:
        return self.top_k * (self.depth - 1)

    def select(self, layer: Layer) -> torch.Tensor:
        p = layer.p.flatten(1)
        keep = torch.zeros_like(p, dtype=torch.bool)
        best = p.topk(min(self.top_k, p.shape[1]), dim=1).indices
        keep.scatter_(1, best, True)
        return (keep & (p > 0)).view_as(layer.p)

    def finish(self, p: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        return top_by_path_probability(p, valid, budget)


class RetrievalPolicy:
    """ALGORITHMS.md section 7: take every retrieved continuation whose path
    probability ``p`` is at least ``min_p``, then prune the least likely
    subtrees (lowest ``p``) until the tree fits the budget.

    Decision: ``min_p`` (not in the paper) drafts only what the evidence
    supports; with the retrieval drafter's calibrated ``q``, ``p`` is the
    node's chance of acceptance, so a node below ``min_p`` is expected to
    add less than ``min_p`` tokens for the cost of a verified row."""

    name = "retrieval"
    PARAMS = {
        "min_p": Param(float, 0.05, "a number from 0 to 1", lambda v: 0.0 <= v <= 1.0),
    }
    grows_past_budget = True
    fanout = 0  # the retrieval drafter's trie decides

    def __init__(self, min_p: float = 0.05) -> None:
        self.min_p = min_p

    def depth_limit(self, budget: int) -> int:
        return 1 << 30  # the drafter's max_depth decides

    def max_fed_nodes(self, budget: int) -> int:
        return 0

    def select(self, layer: Layer) -> torch.Tensor:
        return (layer.candidates.q > 0) & (layer.p >= self.min_p)

    def finish(self, p: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        return top_by_path_probability(p, valid, budget)


POLICIES = {cls.name: cls for cls in (ChainPolicy, Eagle2Policy, RetrievalPolicy)}
