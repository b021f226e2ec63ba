"""Many ranges as one index array, without a loop over them: what a step's
per-request rows become when they are gathered in one operation (the draft
backend's first pass, the paused rows a step keeps, the tree rows' histories)."""

from __future__ import annotations

import numpy as np


def packed_ranges(starts, lengths) -> np.ndarray:
    """``arange(starts[e], starts[e] + lengths[e])`` of every entry, one after
    another."""
    starts, lengths = np.asarray(starts, dtype=np.int64), np.asarray(lengths, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    return np.repeat(starts - offsets, lengths) + np.arange(int(lengths.sum()), dtype=np.int64)
