"""Tree policies: given the drafter's candidates for the frontier, choose the
next layer or stop (``select``), then trim the grown tree (``finish``).

Each policy declares its parameters (``PARAMS``) so the config can be checked
at startup; later policies (TALON, C2T, DEAGLE, DynaTree, EAGLE-2) plug in
through the same two methods.
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

    def select(self, layer: Layer) -> torch.Tensor:
        chosen = torch.zeros_like(layer.candidates.q, dtype=torch.bool)
        chosen[:, 0, 0] = layer.size < layer.budget
        return chosen

    def finish(self, p: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        return valid


class RetrievalPolicy:
    """ALGORITHMS.md section 7: take every retrieved continuation, then prune
    the least likely subtrees (lowest path probability, i.e. cumulative count
    share) until the tree fits the budget."""

    name = "retrieval"
    PARAMS: dict[str, Param] = {}
    grows_past_budget = True

    def select(self, layer: Layer) -> torch.Tensor:
        return layer.candidates.q > 0

    def finish(self, p: torch.Tensor, valid: torch.Tensor, budget: torch.Tensor) -> torch.Tensor:
        return top_by_path_probability(p, valid, budget)


POLICIES = {cls.name: cls for cls in (ChainPolicy, RetrievalPolicy)}
