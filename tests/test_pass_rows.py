"""The first draft pass's packed rows (``adapter/draft_backend.py``,
``adapter/draft_head.py``, ``packed_ranges.py``): every request's rows in one
array, built and split without a loop over the requests."""

from __future__ import annotations

import numpy as np
import torch

from vllm_adaptive_spec.adapter.draft_backend import Committed, PassRows
from vllm_adaptive_spec.adapter.draft_head import _kept_first
from vllm_adaptive_spec.trees.packed_ranges import packed_ranges


def test_packed_ranges_are_the_ranges_one_after_another():
    rng = np.random.default_rng(0)
    for _ in range(20):
        starts, lengths = rng.integers(0, 50, 7), rng.integers(0, 5, 7)
        expected = np.concatenate([np.arange(s, s + n) for s, n in zip(starts, lengths)])
        assert packed_ranges(starts, lengths).tolist() == expected.tolist()
    assert packed_ranges([], []).tolist() == []


def test_committed_entries_keep_their_own_rows():
    committed = Committed(np.array([0, 2, 5]), np.array([1, 2, 7, 8, 9, 11]), np.array([2, 5, 6]),
                          np.array([10, 20, 30]), np.array([4, -1, 6]), np.array([True, False, True]))
    kept = committed.where(np.array([True, False, True]))
    assert kept.batch_rows.tolist() == [0, 5]
    assert kept.rows.tolist() == [1, 2, 11]
    assert kept.lengths.tolist() == [2, 1]
    assert kept.next_tokens.tolist() == [4, 6]


def test_a_split_takes_each_entrys_first_rows_and_leaves_the_rest():
    tokens = torch.arange(100, 106)
    rows = PassRows(tokens, np.arange(6) + 40, tokens[:, None].float(), np.array([3, 1, 2]), np.array([4, 6, 9]))
    first, rest = rows.split(np.array([2, 0, 1]))
    assert first.tokens.tolist() == [100, 101, 104] and first.positions.tolist() == [40, 41, 44]
    assert first.lengths.tolist() == [2, 1] and first.batch_rows.tolist() == [4, 9]
    assert first.aux[:, 0].tolist() == [100.0, 101.0, 104.0]
    assert rest.tokens.tolist() == [102, 103, 105] and rest.lengths.tolist() == [1, 1, 1]
    assert rest.batch_rows.tolist() == [4, 6, 9]


def test_a_padded_pass_keeps_each_entrys_rows_then_repeats_its_last():
    """``[entries, width]`` rows: an entry's own rows in order, then its last
    row again (in range for every index), ``filled`` its own count."""
    tokens = torch.arange(100, 106)
    rows = PassRows(tokens, np.array([40, 41, 42, 7, 90, 91]), tokens[:, None].float(), np.array([3, 1, 2]),
                    np.array([4, 6, 9]))
    padded = rows.padded(4)
    assert padded.tokens.tolist() == [100, 101, 102, 102, 103, 103, 103, 103, 104, 105, 105, 105]
    assert padded.positions.tolist() == [40, 41, 42, 42, 7, 7, 7, 7, 90, 91, 91, 91]
    assert padded.aux[:, 0].tolist() == [float(t) for t in padded.tokens.tolist()]
    assert padded.lengths.tolist() == [4, 4, 4] and padded.batch_rows.tolist() == [4, 6, 9]
    assert padded.own_lengths().tolist() == [3, 1, 2] and rows.own_lengths().tolist() == [3, 1, 2]
    assert padded.padding().tolist() == [False] * 3 + [True] + [False] + [True] * 3 + [False] * 2 + [True] * 2
    assert rows.padding() is None and rows.offsets().tolist() == [0, 3, 4]


def test_kept_rows_of_paused_steps_come_before_a_requests_own():
    """Entry 0 kept nothing; entry 1 kept two rows (in two parts) before its
    three of this step; entry 2 kept one."""
    following = torch.tensor([10, 11, 12, 13, 14, 15, 16])
    hidden = following[:, None].float()
    source = np.array([0, 1, 2, 3, 4, 6])  # entry 0: rows 0-1, entry 1: 2-4, entry 2: 6
    own, first = np.array([2, 3, 1]), np.array([5, 9, 30])
    kept = [None, (7, [torch.tensor([20]), torch.tensor([21])], [torch.tensor([[20.0]]), torch.tensor([[21.0]])]),
            (29, [torch.tensor([30])], [torch.tensor([[30.0]])])]
    tokens, states, index, back = _kept_first(following, hidden, source, own, first, kept)
    assert back.tolist() == [0, 2, 1]
    assert tokens[torch.from_numpy(index)].tolist() == [10, 11, 20, 21, 12, 13, 14, 30, 16]
    assert states[torch.from_numpy(index), 0].tolist() == [10.0, 11.0, 20.0, 21.0, 12.0, 13.0, 14.0, 30.0, 16.0]
