"""What every tree policy shares: the interface and the selection helpers
(a policy's parameters are declared with the config schema's
:class:`~vllm_adaptive_spec.config_schema.Param`).

A policy turns each layer of the drafter's candidates into the next layer of
the tree, or stops (docs/algorithms.md sections 2-6). The growth loop
(:func:`vllm_adaptive_spec.step.growth.grow`) calls ``select`` once per draft
pass for the whole batch; ``finish`` trims the grown trees. Policies with
state per request (DynaTree's history tuning) keep it keyed by request id:
``begin`` before a step's growth, ``observe`` after its verification and
``forget`` when a request finishes or is preempted.
"""

from __future__ import annotations

import torch

from kernels.tree_gating import keep_best
from vllm_adaptive_spec.config_schema import Param
from vllm_adaptive_spec.trees.candidates import Layer
from vllm_adaptive_spec.trees.tree import DraftTree


def top_by_path_probability(p: torch.Tensor, valid: torch.Tensor, max_nodes: torch.Tensor) -> torch.Tensor:
    """Keep each request's ``max_nodes`` nodes of highest path probability.

    Ties go to the earlier node. The kept set is closed under ancestors: a
    child's ``p`` never exceeds its parent's (``q <= 1``) and a parent comes
    first, so it always ranks before its children.
    """
    return keep_best(p, valid, max_nodes)


def best_of_layer(layer: Layer, chosen: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[B, F, C] the ``count`` [B] chosen candidates of highest ``p`` in each
    request's layer (all parents together)."""
    p = layer.p
    return top_by_path_probability(p.flatten(1), chosen.flatten(1), count).view_as(p)


def nodes_left(layer: Layer) -> torch.Tensor:
    """[B] nodes each request may still add before its tree holds ``max_nodes``."""
    return (layer.max_nodes - layer.size).clamp(min=0)


class TreePolicy:
    """Defaults for the optional parts of the interface."""

    PARAMS: dict[str, Param] = {}
    # Whether growth continues once a tree holds ``max_nodes`` nodes (``finish``
    # then trims it back, as after a rerank).
    grows_past_max_nodes = False
    # Candidates per frontier node a model drafter returns (0: the drafter decides).
    fanout = 1
    # The top-M entropy a model drafter computes per node (0: none; C2T's feature).
    entropy_top_m = 0
    # No node whose path probability is below it is ever chosen (a whole-tree
    # drafter may leave such nodes out of its candidate trees).
    floor = 0.0
    # Whether the policy chooses from a drafter's whole candidate trees in one
    # pass (``choose``), and from a batch of them on the device
    # (``choose_tensors``), as the layer loop would (``growth.grow``).
    chooses_trees = False
    chooses_tensors = False

    def depth_limit(self, max_nodes: int) -> int:
        """The deepest layer grown when the largest tree may hold ``max_nodes``."""
        return max_nodes

    def layer_width(self, max_nodes: int) -> int:
        """The most candidates one layer chooses per request (fixed-capacity
        growth, ``growth.grow_fixed``): a policy that never grows past ``max_nodes``
        chooses at most what is left of it."""
        return max_nodes

    def max_fed_nodes(self, max_nodes: int) -> int:
        """Nodes a model drafter runs on while growing one tree (its KV scratch):
        a policy that never grows past ``max_nodes`` feeds at most ``max_nodes - 1``
        (a frontier is fed only while its tree has room)."""
        return max_nodes - 1

    def select(self, layer: Layer) -> torch.Tensor:
        """[B, F, C] bool: the candidates that form the next layer (none: stop);
        a policy may set ``layer.stop`` for requests that keep this layer but
        grow no deeper."""
        raise NotImplementedError

    def finish(self, p: torch.Tensor, valid: torch.Tensor, max_nodes: torch.Tensor) -> torch.Tensor:
        """[B, M] bool: which grown nodes (path probabilities ``p``) to keep."""
        return valid

    def choose(self, tree: DraftTree, max_nodes: int) -> DraftTree:
        """The tree the layer loop would grow from a whole candidate ``tree`` (``chooses_trees``)."""
        raise NotImplementedError

    def choose_tensors(self, trees, max_nodes: torch.Tensor, width: int):
        """:meth:`choose` over a batch of candidate trees on the device (``chooses_tensors``)."""
        raise NotImplementedError

    def begin(self, request_ids: list[str]) -> None:
        """A step's growth starts for these requests (batch order)."""

    def observe(self, request_id: str, tree: DraftTree, accepted: int) -> None:
        """The request's verified ``tree`` had ``accepted`` nodes accepted."""

    def forget(self, request_id: str) -> None:
        """The request finished or was preempted."""

    def requests_held(self) -> int:
        """How many requests the policy keeps state for."""
        return 0
