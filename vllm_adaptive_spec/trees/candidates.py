"""What a drafter offers and a policy sees: the candidate children of a
tree's frontier (:class:`Candidates`), a layer of them with its path
probabilities and node limits (:class:`Layer`), and what a drafter can do beyond
growing layer by layer (:class:`Growth`, :class:`Drafter`). The growth loop
(:mod:`~vllm_adaptive_spec.step.growth`), above both, passes them between
the two; drafters and policies import them from here."""

from __future__ import annotations

from dataclasses import dataclass, field
import enum
from typing import Protocol

import torch


@dataclass
class Candidates:
    """Children of the frontier: ``tokens``/``q``/``handles`` [B, F, C]; a
    candidate with ``q == 0`` does not exist. Children of one frontier node are
    sorted by descending ``q`` and carry distinct tokens. ``handles`` None:
    each candidate's handle is its index in the layer, ``f * C + c`` (a model
    drafter's; no tensor to build a layer). ``entropy`` [B, F]: the entropy
    of each frontier node's draft distribution over its top ``M``
    probabilities (C2T's feature; None where the drafter has none)."""

    tokens: torch.Tensor
    q: torch.Tensor
    handles: torch.Tensor | None = None
    entropy: torch.Tensor | None = None

    @property
    def confidence(self) -> torch.Tensor:
        """[B, F] each frontier node's largest draft probability (its first child's ``q``)."""
        return self.q[..., 0]


@dataclass
class Layer:
    """What a policy sees: the candidates, the frontier's path probabilities
    ``parent_p`` [B, F] (0 on empty slots), the candidates' ``depth`` (1 for
    children of the root), the nodes already in each tree ``size`` [B] and
    the most nodes each tree may hold ``max_nodes`` [B]. ``stop`` [B] starts
    False; a policy sets it for the requests whose chosen layer is their last
    (it is not expanded).
    ``score`` [B, F, C]: what the final cut (``finish``) ranks the chosen
    candidates by; a policy may set it (C2T: its classifier's confidence),
    else it is ``p``. ``parent_score`` [B, F]: the frontier's scores."""

    candidates: Candidates
    parent_p: torch.Tensor
    depth: int
    size: torch.Tensor
    max_nodes: torch.Tensor
    stop: torch.Tensor | None = None
    parent_score: torch.Tensor | None = None
    score: torch.Tensor | None = None
    # [B, F, C] path probability of every candidate, ``p(parent) * q``: once
    # a layer (policies and the packing read it several times).
    p: torch.Tensor = field(init=False)

    def __post_init__(self) -> None:
        if self.stop is None:
            self.stop = torch.zeros_like(self.max_nodes, dtype=torch.bool)
        self.p = self.parent_p.unsqueeze(-1) * self.candidates.q


class Growth(enum.Enum):
    """What a drafter can do beyond growing layer by layer on the host."""

    LAYERS = "layers"  # ``expand`` only
    FIXED_LAYERS = "fixed layers"  # its layers run at fixed capacity, nothing read back (:func:`grow_fixed`)
    WHOLE_TREES = "whole trees"  # ``candidate_trees``: every request's candidates before growth
    WHOLE_TENSORS = "whole tensors"  # and ``candidate_tensors``: the same on its device


class Drafter(Protocol):
    """What :func:`grow` asks of a drafter; beyond ``expand``, what its
    ``growth`` declares (and, for ``FIXED_LAYERS`` and ``WHOLE_TENSORS``,
    the ``device`` its tensors are on)."""

    growth: Growth

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        """Candidates for the frontier nodes ``handles`` [B, F] (``live`` marks
        real nodes; a handle of -1 is the root)."""
