"""What a uniform decode step costs, measured per (batch, rows a request).

On a GPU a uniform tree step (``uniform_widths``) replays a captured graph of
``b`` requests with ``R`` rows each, ``b`` padded to the next captured batch
size: a padding row costs what a filled row costs, and rows cost almost
nothing up to the device's width and then in full. A line through the
measured steps (``cost_fit.StepCostFit``) is the wrong model there (a captured
graph pays its padded rows whatever the tree); a table of the measured times of each (padded batch, ``R``) is
the right one, since those are the only shapes the step can take.

Decision: each cell is an exponentially weighted mean over its own
measurements (half-life ``half_life`` of them), so a cell measured once is
known and a cell measured often follows drift. An unmeasured ``R`` at a
measured batch is estimated as the cost of the widest measured ``R`` below
it (rows are nearly free on a GPU, so the estimate is optimistic): a width
never tried is tried once, then known.
"""

from __future__ import annotations

import bisect


class StepCostTable:
    def __init__(self, batch_sizes: tuple[int, ...] = (), half_life: float = 16.0) -> None:
        self.batch_sizes = tuple(sorted(batch_sizes))  # what a batch pads to (empty: as it is)
        self.decay = 0.5 ** (1.0 / half_life)
        self._cells: dict[tuple[int, int], list[float]] = {}  # (batch, rows) -> [weight, weighted seconds]

    def padded(self, batch: int) -> int:
        """The captured batch size ``batch`` requests replay (itself beyond the largest)."""
        index = bisect.bisect_left(self.batch_sizes, batch)
        return self.batch_sizes[index] if index < len(self.batch_sizes) else batch

    def observe(self, batch: int, rows: int, seconds: float) -> None:
        """A uniform decode step of ``batch`` requests, ``rows`` rows each, took ``seconds``."""
        cell = self._cells.setdefault((self.padded(batch), rows), [0.0, 0.0])
        cell[0] = cell[0] * self.decay + 1.0
        cell[1] = cell[1] * self.decay + seconds

    def measured(self, batch: int, rows: int) -> float | None:
        cell = self._cells.get((self.padded(batch), rows))
        return None if cell is None else cell[1] / cell[0]

    def cost(self, batch: int, rows: int) -> float | None:
        """Seconds of a step of ``batch`` requests with ``rows`` rows each:
        measured, else the widest measured narrower step's, else None."""
        measured = self.measured(batch, rows)
        if measured is not None:
            return measured
        key = self.padded(batch)
        narrower = [r for b, r in self._cells if b == key and r < rows]
        return self.measured(batch, max(narrower)) if narrower else None
