"""DynaTree: per-node branching from the drafter's confidence (seed 003; docs/algorithms.md section 6)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from kernels.tree_gating import dynatree_gate
from vllm_adaptive_spec.config_schema import Param, fraction, integer
from vllm_adaptive_spec.policies.base import TreePolicy, nodes_left
from vllm_adaptive_spec.trees.candidates import Layer
from vllm_adaptive_spec.trees.tree import DraftTree


@dataclass
class _History:
    """One request's tuned depth ``D_0`` and confidence threshold ``tau_h``,
    and its last acceptance ratios."""

    d0: int
    tau_h: float
    ratios: deque = field(default_factory=deque)


class DynaTreePolicy(TreePolicy):
    """A frontier node ``u`` with confidence ``c(u)`` (the largest draft
    probability after ``u``) gets ``B_min`` children if ``c >= tau_h``,
    ``B_mid`` if ``tau_l <= c < tau_h`` and ``B_max`` below ``tau_l``; it is
    expanded only if ``d(u) < D_max``, ``p(u) >= rho_stop`` and
    (``d(u) < D_0`` or ``p(u) >= rho_deep``); no node with ``p < tau`` is
    kept; growth stops at ``N`` nodes (a layer that would overflow keeps
    its best by ``p``). One draft pass per depth for the whole batch.

    History tuning (docs/algorithms.md): each request keeps the
    acceptance ratio ``accepted / tree depth`` of its last ``W`` verified
    trees; when their mean is above 0.7, ``D_0 += 1`` (at most ``D_max``) and
    ``tau_h -= 0.05`` (at least 0.5); below 0.3, ``D_0 -= 1`` (at least 1)
    and ``tau_h += 0.05`` (at most 0.99). Decision: the window is cleared
    after each adjustment, so one run of good or bad steps moves the
    settings one notch per ``W`` steps rather than at every step. The gates
    and the cut to ``N`` are one fused operation for the batch
    (``kernels.tree_gating``), reading each request's ``D_0`` and ``tau_h``
    from device tensors."""

    name = "dynatree"
    PARAMS = {
        "d0": integer(5, 1, 64),
        "d_max": integer(8, 1, 64),
        "branch_min": integer(1, 1, 16),
        "branch_mid": integer(2, 1, 16),
        "branch_max": integer(3, 1, 16),
        "tau_h": fraction(0.9),
        "tau_l": fraction(0.4),
        "tau": fraction(0.03),
        "rho_stop": fraction(0.01),
        "rho_deep": fraction(0.1),
        "window": integer(8, 1, 1024),
        "history_tuning": Param(bool, True, "true or false", lambda v: isinstance(v, bool)),
    }
    RAISE, LOWER = 0.7, 0.3  # mean acceptance ratios that deepen / shallow the tree
    STEP, TAU_H_RANGE = 0.05, (0.5, 0.99)

    def __init__(
        self,
        d0: int = 5,
        d_max: int = 8,
        branch_min: int = 1,
        branch_mid: int = 2,
        branch_max: int = 3,
        tau_h: float = 0.9,
        tau_l: float = 0.4,
        tau: float = 0.03,
        rho_stop: float = 0.01,
        rho_deep: float = 0.1,
        window: int = 8,
        history_tuning: bool = True,
    ) -> None:
        if not branch_min <= branch_mid <= branch_max:
            raise ValueError(f"branch_min <= branch_mid <= branch_max must hold, got {branch_min}, {branch_mid}, {branch_max}")
        if tau_l > tau_h:
            raise ValueError(f"tau_l ({tau_l}) must not exceed tau_h ({tau_h})")
        if d0 > d_max:
            raise ValueError(f"d0 ({d0}) must not exceed d_max ({d_max})")
        self.d0, self.d_max = d0, d_max
        self.branches = (branch_min, branch_mid, branch_max)
        self.tau_h, self.tau_l, self.tau = tau_h, tau_l, tau
        self.rho_stop, self.rho_deep = rho_stop, rho_deep
        self.window, self.history_tuning = window, history_tuning
        self.fanout = branch_max
        self._history: dict[str, _History] = {}
        self._row_d0: torch.Tensor | None = None
        self._row_tau_h: torch.Tensor | None = None

    def depth_limit(self, max_nodes: int) -> int:
        return self.d_max

    def begin(self, request_ids: list[str]) -> None:
        rows = [self._history.get(r) for r in request_ids]
        self._row_d0 = torch.tensor([h.d0 if h else self.d0 for h in rows], dtype=torch.long)
        self._row_tau_h = torch.tensor([h.tau_h if h else self.tau_h for h in rows])

    def _rows(self, batch: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[B] ``D_0`` and ``tau_h`` of this step's requests on ``device`` (the
        defaults when growth was not started by :meth:`begin`, as in offline use)."""
        if self._row_d0 is not None and self._row_d0.shape[0] == batch:
            if self._row_d0.device != device:  # once a step: a fixed draft loop grows on the model's device
                self._row_d0, self._row_tau_h = self._row_d0.to(device), self._row_tau_h.to(device)
            return self._row_d0, self._row_tau_h
        return torch.full((batch,), self.d0, device=device), torch.full((batch,), self.tau_h, device=device)

    def select(self, layer: Layer) -> torch.Tensor:
        d0, tau_h = self._rows(layer.max_nodes.shape[0], layer.max_nodes.device)
        exists = layer.candidates.q > 0
        return dynatree_gate(
            layer.p, exists, layer.parent_p, layer.candidates.confidence, nodes_left(layer), d0, tau_h,
            layer.depth - 1, self.d_max, self.branches, self.tau_l, self.tau, self.rho_stop, self.rho_deep,
        )

    def observe(self, request_id: str, tree: DraftTree, accepted: int) -> None:
        tree_depth = max(tree.depths(), default=0)
        if not self.history_tuning or tree_depth <= 0:
            return
        history = self._history.setdefault(request_id, _History(self.d0, self.tau_h))
        history.ratios.append(accepted / tree_depth)
        if len(history.ratios) < self.window:
            return
        mean = sum(history.ratios) / len(history.ratios)
        history.ratios.clear()
        low, high = self.TAU_H_RANGE
        if mean > self.RAISE:
            history.d0 = min(history.d0 + 1, self.d_max)
            history.tau_h = max(history.tau_h - self.STEP, low)
        elif mean < self.LOWER:
            history.d0 = max(history.d0 - 1, 1)
            history.tau_h = min(history.tau_h + self.STEP, high)

    def forget(self, request_id: str) -> None:
        self._history.pop(request_id, None)

    def requests_held(self) -> int:
        return len(self._history)
