"""The EAGLE-3 head's rows of paused steps (``PausedRows``): what is kept comes
back in order, memory is counted exactly, and the byte bound holds."""

import random

import pytest
import torch

from vllm_adaptive_spec.trees.paused_rows import PausedRows

WIDTH = 6


def step_rows(positions: dict[str, int], lengths: dict[str, int]):
    """A step's gathered rows for the requests in ``lengths``: token = 1000 *
    request number + position, hidden states filled with the token."""
    spans, tokens, offset = [], [], 0
    for request_id, length in lengths.items():
        p0 = positions[request_id]
        spans.append((request_id, p0, offset, length))
        tokens += [1000 * int(request_id[1:]) + p for p in range(p0, p0 + length)]
        offset += length
    tokens = torch.tensor(tokens, dtype=torch.long)
    return tokens, tokens.to(torch.float32).unsqueeze(1).repeat(1, WIDTH), spans


def live_block_rows(paused: PausedRows) -> int:
    """Rows of the distinct tensors the kept rows are views of: the memory held."""
    blocks = {id(block): block.rows for kept in paused._kept.values() for block, _, _ in kept.parts}
    return sum(blocks.values())


def test_a_whole_paused_batch_is_kept_without_a_copy_and_comes_back_in_order():
    paused = PausedRows(1 << 30)
    positions = {"r1": 10, "r2": 20}
    firsts = []
    for lengths in ({"r1": 3, "r2": 1}, {"r1": 1, "r2": 1}, {"r1": 2, "r2": 1}):
        tokens, hidden, spans = step_rows(positions, lengths)
        firsts.append(tokens)
        paused.keep(tokens, hidden, spans)
        for request_id, length in lengths.items():
            positions[request_id] += length
    assert paused.kept_rows == paused.block_rows == 9
    kept_views = [block.tokens for block, _, _ in paused._kept["r1"].parts]
    assert all(view is step for view, step in zip(kept_views, firsts))  # the step's own tensors
    start, tokens, hidden = paused.take("r1", positions["r1"])
    assert start == 10
    assert torch.cat(tokens).tolist() == [1000 + p for p in range(10, 16)]
    assert torch.equal(torch.cat(hidden)[:, 0], torch.cat(tokens).float())
    assert paused.kept_rows == 3 and paused.block_rows == 9  # r2 still holds every block
    paused.bound()  # 9 rows held for 3 kept: compacted
    assert paused.block_rows == 3 == live_block_rows(paused)
    start, tokens, _ = paused.take("r2", positions["r2"])
    assert (start, torch.cat(tokens).tolist()) == (20, [2020, 2021, 2022])
    assert paused.block_rows == paused.kept_rows == paused.requests_held() == 0


def test_rows_of_requests_not_paused_are_left_out_of_the_block():
    paused = PausedRows(1 << 30)
    tokens, hidden, spans = step_rows({"r1": 0, "r2": 5, "r3": 9}, {"r1": 2, "r2": 3, "r3": 1})
    paused.keep(tokens, hidden, [spans[0], spans[2]])  # r2 drafts this step
    assert paused.block_rows == paused.kept_rows == 3
    assert paused.rows("r2") == 0
    _, kept, _ = paused.take("r3", 10)
    assert torch.cat(kept).tolist() == [3009]


def test_rows_that_do_not_continue_the_kept_ones_are_not_returned():
    paused = PausedRows(1 << 30)
    tokens, hidden, spans = step_rows({"r1": 0}, {"r1": 2})
    paused.keep(tokens, hidden, spans)
    tokens, hidden, spans = step_rows({"r1": 5}, {"r1": 1})  # a gap: positions 2..4 never seen
    paused.keep(tokens, hidden, spans)
    assert paused.rows("r1") == 1 and paused.kept_rows == 1 == paused.block_rows
    assert paused.take("r1", 7) is None  # kept rows end at 6
    assert paused.requests_held() == paused.block_rows == 0


def test_beyond_the_bound_the_largest_give_up_and_memory_falls_under_it():
    row_bytes = WIDTH * 4 + 8
    paused = PausedRows(10 * row_bytes)
    positions = {"r1": 0, "r2": 0, "r3": 0}
    for lengths in ({"r1": 4, "r2": 2, "r3": 1}, {"r1": 1, "r2": 1, "r3": 1}, {"r1": 1, "r2": 1, "r3": 1}):
        tokens, hidden, spans = step_rows(positions, lengths)
        paused.keep(tokens, hidden, spans)
        for request_id, length in lengths.items():
            positions[request_id] += length
        paused.bound()
        assert paused.bytes <= paused.limit_bytes and paused.row_bytes == row_bytes
    assert paused.given_up == {"r1", "r2"}  # 13 rows kept after the last step: down to 5 or fewer
    assert paused.kept_rows == 3 and paused.block_rows == live_block_rows(paused) == 3
    assert paused.take("r1", positions["r1"]) is None
    paused.drop(["r1", "r2", "r3"])
    assert paused.requests_held() == paused.block_rows == 0


@pytest.mark.parametrize("seed", range(6))
def test_random_pauses_keep_every_row_and_count_memory_exactly(seed):
    rng = random.Random(seed)
    row_bytes = WIDTH * 4 + 8
    paused = PausedRows(rng.choice([12, 40, 1 << 20]) * row_bytes)
    positions = {f"r{k}": rng.randrange(50) for k in range(1, 7)}
    expected: dict[str, list[int]] = {}  # what each request keeps, by the reference
    first: dict[str, int] = {}
    for step in range(60):
        live = [r for r in positions if rng.random() < 0.8]
        lengths = {r: rng.choice([1, 1, 1, 2, 5]) for r in live}
        tokens, hidden, spans = step_rows(positions, lengths)
        keeping = [span for span in spans if rng.random() < 0.7]
        for request_id, p0, _, length in spans:
            if any(span[0] == request_id for span in keeping):
                if request_id not in paused.given_up:
                    first.setdefault(request_id, p0)
                    expected.setdefault(request_id, []).extend(range(1000 * int(request_id[1:]) + p0,
                                                                     1000 * int(request_id[1:]) + p0 + length))
            elif request_id not in paused.given_up:  # drafts: takes what it kept
                taken = paused.take(request_id, p0)
                want = expected.pop(request_id, [])
                if want:
                    start, kept, hidden_parts = taken
                    assert start == first.pop(request_id)
                    assert torch.cat(kept).tolist() == want
                    assert torch.cat(hidden_parts)[:, -1].tolist() == [float(t) for t in want]
                else:
                    assert taken is None
        paused.keep(tokens, hidden, [span for span in keeping if span[0] not in paused.given_up])
        for request_id, length in lengths.items():
            positions[request_id] += length
        if rng.random() < 0.1:  # a request finishes; a new one takes its place
            gone = rng.choice(list(positions))
            paused.drop([gone])
            expected.pop(gone, None)
            first.pop(gone, None)
            del positions[gone]
            positions[f"r{100 + step}"] = 0
        paused.bound()
        for request_id in paused.given_up:
            expected.pop(request_id, None)
            first.pop(request_id, None)
        assert paused.block_rows == live_block_rows(paused)
        assert paused.kept_rows == sum(len(rows) for rows in expected.values())
        assert paused.bytes <= paused.limit_bytes
        assert paused.block_rows <= 2 * paused.kept_rows
