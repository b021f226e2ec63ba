"""How many draft passes a model drafter's step runs: the draft side of the
load budget (docs/algorithms.md section 8, "Draft depth").

A model drafter's tree of depth ``d`` costs its first pass (over the
request's newly committed tokens, which also gives the root's children) and
``d - 1`` passes more, one a layer. Before this, every drafting step paid
the policy's whole depth whatever a pass cost at its batch, so the budget
could choose what to verify but not what to draft: a head whose deep
layers do not pay their passes could only be paused. Now, per batch shape
(the drafting requests, rounded up to a power of two), it keeps:

* the drafting time of a step, a decayed least-squares line on the passes
  beyond the first: ``first`` (what a one-layer tree costs) and ``layer``
  (a pass more). While only one depth has been seen the line cannot be
  split, and a layer is taken to cost its share of the step's drafting
  (``seconds / passes``): both are one forward of the same model over the
  same requests.
* what each depth ``k`` brings: per drafting request, the calibrated path
  probabilities (``p_hat``, the expected accepted tokens) of the nodes the
  budget kept at depth ``k`` and how many they were (decayed means over the
  steps that grew that deep).

The depth is the ``d`` in ``1..D`` (``D``: what the policy may grow) of the
highest expected committed tokens per second,
``(B + R * sum_{k<=d} g_k) / (verify(R, sum_{k<=d} n_k) + first + layer * (d - 1))``
with ``B`` decoding requests, ``R`` of them drafting, and ``verify`` the step
mode's cost model (``cost_models``). A one-pass wide tree (``d = 1``), a
chain and the policy's whole tree are all in this search; the policy's own
rule (TALON's gate, DEAGLE's vote, DynaTree's branching, C2T's classifier,
EAGLE-2's top-k) shapes the tree within the depth. No drafting at all is
the pause control's decision (``pause_control``), judged on measured steps.

Decisions: a depth never grown has no measured gain, so until a shape has
measured its depths it grows the policy's whole depth; after that, one
drafting step in ``EXPLORE`` grows one layer deeper than chosen, so the gain
of the next depth stays measured while the head's confidence drifts (an
unmeasured depth is not chosen: its gain is not guessed).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

EXPLORE = 8  # one drafting step in EXPLORE grows a layer deeper than chosen
MAX_TRACKED_DEPTH = 64  # the policies' largest depth parameter


def shape_of(requests: int) -> int:
    """The batch shape a step of ``requests`` drafting requests is kept under."""
    return 1 << max(requests - 1, 0).bit_length()


class _ShapeRecord:
    """One batch shape's drafting time and per-depth gains (decayed sums)."""

    def __init__(self) -> None:
        self.gram = np.zeros((2, 2))  # decayed sums over steps of x x^T and x t, x = [1, passes - 1]
        self.moment = np.zeros(2)
        self.gain = np.zeros(MAX_TRACKED_DEPTH)  # decayed sums of p_hat per drafting request, by depth - 1
        self.nodes = np.zeros(MAX_TRACKED_DEPTH)
        self.weight = np.zeros(MAX_TRACKED_DEPTH)  # decayed count of steps that grew that deep
        self.steps = 0

    def drafting_seconds(self, depth: int) -> float:
        """A step's modelled drafting time at ``depth`` (0: none measured)."""
        weight = self.gram[0, 0]
        if weight <= 0.0:
            return 0.0
        if np.linalg.det(self.gram) > 1e-9 * weight * weight:
            first, layer = np.linalg.solve(self.gram, self.moment)
            if first >= 0.0 and layer >= 0.0:
                return float(first + layer * (depth - 1))
        mean_passes = 1.0 + self.gram[0, 1] / weight
        return float(self.moment[0] / weight / mean_passes * depth)

    def measured_depths(self) -> int:
        """The deepest depth of which every depth up to it has a measured gain."""
        unseen = np.flatnonzero(self.weight <= 1e-9)
        return int(unseen[0]) if unseen.size else MAX_TRACKED_DEPTH


class DraftDepth:
    """The depth decision of one load budget; ``half_life`` in drafting steps of a shape."""

    def __init__(self, half_life: float = 64.0) -> None:
        self.decay = 0.5 ** (1.0 / half_life)
        self._shapes: dict[int, _ShapeRecord] = {}
        self.choices = np.zeros(MAX_TRACKED_DEPTH + 1, dtype=np.int64)  # steps per chosen depth (the stats')

    def _record(self, requests: int) -> _ShapeRecord:
        return self._shapes.setdefault(shape_of(requests), _ShapeRecord())

    def observe_drafting(self, requests: int, seconds: float, passes: int) -> None:
        """A step drafted ``requests`` trees ``passes`` passes deep (its
        first pass included) in ``seconds``."""
        if requests <= 0 or passes <= 0:
            return
        record = self._record(requests)
        x = np.array([1.0, passes - 1.0])
        record.gram = record.gram * self.decay + np.outer(x, x)
        record.moment = record.moment * self.decay + x * seconds

    def observe_kept(self, requests: int, gains: np.ndarray, nodes: np.ndarray) -> None:
        """What a step kept of its ``requests`` trees: ``gains[k]`` and
        ``nodes[k]``, the summed ``p_hat`` and the count of their kept nodes
        at depth ``k + 1``, for every depth the step grew (``kept_by_depth``)."""
        depth = min(len(gains), MAX_TRACKED_DEPTH)
        if requests <= 0 or depth <= 0:
            return
        record = self._record(requests)
        record.gain[:depth] = record.gain[:depth] * self.decay + gains[:depth] / requests
        record.nodes[:depth] = record.nodes[:depth] * self.decay + nodes[:depth] / requests
        record.weight[:depth] = record.weight[:depth] * self.decay + 1.0

    def drafting_seconds(self, requests: int, depth: int) -> float:
        """A step's modelled drafting time for ``requests`` trees ``depth``
        passes deep (0: nothing measured at this batch shape)."""
        record = self._shapes.get(shape_of(requests))
        return 0.0 if record is None else record.drafting_seconds(depth)

    def choose(self, requests: int, plain: int, limit: int,
               verify_seconds: Callable[[float, int], float] | None) -> int:
        """The depth (``1..limit``) of a step with ``requests`` drafting and
        ``plain`` other decoding requests; ``verify_seconds(nodes, depth)``:
        the modelled verify step with ``nodes`` kept nodes per drafting
        request, ``depth`` deep (None: the cost model does not know the step
        yet, so the policy's whole depth is grown)."""
        depth = self._chosen(requests, plain, limit, verify_seconds)
        self.choices[min(depth, MAX_TRACKED_DEPTH)] += 1
        return depth

    def _chosen(self, requests: int, plain: int, limit: int, verify_seconds) -> int:
        if limit <= 1 or requests <= 0:
            return max(limit, 0)
        record = self._record(requests)
        record.steps += 1
        measured = record.measured_depths()
        if verify_seconds is None or record.gram[0, 0] <= 0.0 or measured < min(limit, MAX_TRACKED_DEPTH):
            return limit
        weight = np.maximum(record.weight[:limit], 1e-12)
        gains = np.cumsum(record.gain[:limit] / weight)
        nodes = np.cumsum(record.nodes[:limit] / weight)
        batch = requests + plain
        rates = [(batch + requests * gains[d - 1])
                 / (verify_seconds(float(nodes[d - 1]), d) + record.drafting_seconds(d)) for d in range(1, limit + 1)]
        best = int(np.argmax(rates)) + 1
        return min(best + 1, limit) if record.steps % EXPLORE == 0 else best


def kept_by_depth(trees, factors: list[float], depth: int) -> tuple[np.ndarray, np.ndarray]:
    """The summed ``p_hat`` and the count of the kept nodes of ``trees``
    (each with its ``factor``) at each depth ``1..depth``."""
    gains, nodes = np.zeros(depth), np.zeros(depth)
    for tree, factor in zip(trees, factors):
        if not len(tree):
            continue
        levels = np.asarray(tree.depths(), dtype=np.int64) - 1
        inside = levels < depth
        np.add.at(gains, levels[inside], factor * np.asarray(tree.path_probabilities())[inside])
        np.add.at(nodes, levels[inside], 1.0)
    return gains, nodes
