"""How far a drafter's path probabilities can be trusted: the load budget's
calibration ``factor`` (docs/algorithms.md section 8).

``factor`` is the ratio of accepted nodes to the summed path probability ``p``
of verified nodes, decayed per tree (half-life ``half_life``), so an
optimistic drafter is discounted. Request ``r``'s own ratio is shrunk toward
it, ``(a_r + k * factor) / (P_r + k)`` with ``a_r``, ``P_r`` its accepted and
predicted nodes (faded a step at a time, half-life ``request_half_life``)
and ``k = request_prior``: a request whose trees are accepted deeply keeps
more nodes than one whose trees fail on the same evidence.
"""

from __future__ import annotations

from dataclasses import dataclass

from vllm_adaptive_spec.budget.node_allocation import MAX_FACTOR
from vllm_adaptive_spec.trees.tree import DraftTree

MIN_FACTOR = 0.05  # the calibration's smallest value


@dataclass
class Record:
    """A request's predicted and accepted nodes, faded a step at a time."""

    predicted: float = 0.0
    accepted: float = 0.0


class Calibration:
    def __init__(self, half_life: float = 200.0, request_half_life: float = 32.0, request_prior: float = 4.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self.request_decay = 0.5 ** (1.0 / request_half_life)
        self.request_prior = request_prior
        self.predicted = 1.0  # decayed sums for factor = accepted / predicted
        self.accepted = 1.0
        self._requests: dict[str, Record] = {}

    def observe(self, tree: DraftTree, accepted_nodes: int, request_id: str | None = None) -> None:
        """A verified tree (of ``request_id``) and how many of its nodes were accepted."""
        predicted = sum(tree.path_probabilities())
        self.predicted = self.predicted * self.decay + predicted
        self.accepted = self.accepted * self.decay + accepted_nodes
        if request_id is not None:
            record = self._requests.setdefault(request_id, Record())
            record.predicted += predicted
            record.accepted += accepted_nodes

    def fade(self, request_ids) -> None:
        """A step went by for these requests, verified or not."""
        for request_id in request_ids:
            record = self._requests.get(request_id)
            if record is not None:
                record.predicted *= self.request_decay
                record.accepted *= self.request_decay

    def factor(self, request_id: str | None = None) -> float:
        """The engine's ``factor``, or request ``request_id``'s own shrunk toward it."""
        factor = _clipped(self.accepted / max(self.predicted, 1e-9))
        record = self._requests.get(request_id)
        if record is None:
            return factor
        return _clipped((record.accepted + self.request_prior * factor) / (record.predicted + self.request_prior))

    def forget(self, request_id: str) -> None:
        self._requests.pop(request_id, None)

    def requests_held(self) -> int:
        return len(self._requests)


def _clipped(factor: float) -> float:
    """``factor`` within [MIN_FACTOR, MAX_FACTOR] (a Python float: read for every
    request every step, where numpy's clip of a scalar costs ten times more)."""
    return float(min(max(factor, MIN_FACTOR), MAX_FACTOR))
