"""On the CPU engine: the device part of a tree step, ragged or uniform,
reads no value back to the host, and dispatches the same operations
whatever the batch and the tree size (``tests/step_guard.py``: a guard counted at the dispatcher,
installed in the real engine's worker)."""

from __future__ import annotations

from collections import Counter

import pytest

from conftest import HEAD, chat_token_ids, run_engine_job
from vllm_adaptive_spec.prompts import load_prompts

pytestmark = pytest.mark.engine

MAX_TOKENS = 8  # 7 tree steps a run: enough to compare, and half the forward of 12


@pytest.fixture(scope="module")
def prompt_ids(demo_tokenizer):
    return [chat_token_ids(demo_tokenizer, p.messages) for p in load_prompts()]


def last_tokens(prompt_ids, batch: int, cut: int) -> list[list[int]]:
    """``batch`` prompts cut to their last ``cut`` tokens, or to 48 above
    batch 8: the prefill is not what is measured (prompts of 160 tokens at
    batch 64 took a third of the test)."""
    return [prompt_ids[k % len(prompt_ids)][-(cut if batch <= 8 else 48):] for k in range(batch)]


def guarded_run(tmp_path, demo_model, prompt_ids, batch: int, nodes: int, shape: str = "ragged") -> dict:
    tree = {"drafter": "retrieval", "policy": "retrieval", "load_budget": "fixed", "step_shape": shape}
    run = run_engine_job(tmp_path, {
        "model": demo_model, "prompt_token_ids": last_tokens(prompt_ids, batch, 160),
        "max_tokens": MAX_TOKENS, "max_num_seqs": batch, "step_guard": True,
        "speculative_config": {"method": "adaptive_tree", "num_speculative_tokens": nodes, "tree": tree},
    })
    return run.step_guard


def signature(step: list) -> tuple:
    return tuple(tuple(op) for op in step)


def assert_one_signature(steps: list) -> tuple | None:
    """The one list of operations every step dispatched (None for no step);
    else fails naming the operations whose counts differ, ``op: (first, other)``."""
    signatures = Counter(signature(step) for step in steps)
    if len(signatures) > 1:
        first, *others = [dict(s) for s in signatures]
        raise AssertionError([{op: (first.get(op), other.get(op)) for op in first.keys() | other.keys()
                               if first.get(op) != other.get(op)} for other in others])
    return next(iter(signatures), None)


@pytest.mark.parametrize("shape", ["ragged", "uniform"])
def test_a_tree_step_reads_nothing_back_and_its_operations_do_not_grow(shape, tmp_path, demo_model, prompt_ids):
    small = guarded_run(tmp_path / "b8", demo_model, prompt_ids, batch=8, nodes=4, shape=shape)
    large = guarded_run(tmp_path / "b16", demo_model, prompt_ids, batch=16, nodes=16, shape=shape)
    for run in (small, large):
        assert run["reads"] == []
        assert len(run["tree_steps"]) >= 3
        assert (len(run["layouts"]) >= 3) == (shape == "uniform")  # the uniform layout ran, and only there
    # Every tree step of both runs dispatched one and the same list of operations, and so did
    # every uniform step's layout.
    for part in ("tree_steps", "layouts"):
        assert_one_signature([step for run in (small, large) for step in run[part]])


def draft_run(tmp_path, demo_model, prompt_ids, batch: int, shape: str, max_tokens: int) -> dict:
    tree = {"drafter": "eagle3", "policy": "eagle2", "top_k": 4, "depth": 5, "load_budget": "fixed",
            "step_shape": shape}
    return run_engine_job(tmp_path, {
        "model": demo_model, "prompt_token_ids": last_tokens(prompt_ids, batch, 96),
        "max_tokens": max_tokens, "max_num_seqs": batch, "step_guard": shape == "uniform",
        "speculative_config": {"method": "adaptive_tree", "num_speculative_tokens": 16, "model": HEAD,
                               "tree": tree},
    })


def test_a_fixed_draft_loop_reads_nothing_back_and_its_operations_do_not_grow(tmp_path, demo_model, prompt_ids):
    """An EAGLE-3 head's draft loop at fixed capacity (``step_shape:
    uniform``: every layer ``B x F`` rows on the model's device)
    reads no value back in its layouts, forwards and policy, and dispatches
    the same operations at batch 8 and 16 (the CPU's own draft attention left
    out: on a GPU the kernel reads the pages); so does its first pass over
    the step's committed rows, whose layout is the host's already, and the
    start of its trees. EAGLE-2 chooses at most
    ``top_k`` nodes a layer, which the fixed width holds, so it grows the
    ragged loop's trees: the same output, nodes verified and accepted."""
    small = draft_run(tmp_path / "b8", demo_model, prompt_ids, 8, "uniform", 10)
    ragged = draft_run(tmp_path / "b8-ragged", demo_model, prompt_ids, 8, "ragged", 10)
    large = draft_run(tmp_path / "b16", demo_model, prompt_ids, 16, "uniform", 5)
    for run in (small.step_guard, large.step_guard):
        assert run["reads"] == []
        assert len(run["draft_loops"]) >= 3
    loop = assert_one_signature([loop for run in (small, large) for loop in run.step_guard["draft_loops"]])
    assert sum(count for _, count in loop) > 100  # the loop's operations are seen
    # A first pass dispatches the same operations at batch 16 as at batch 8
    # (steps with verified trees gather the committed rows, others slice them).
    small_passes, large_passes = ({signature(p) for p in run.step_guard["first_passes"]} for run in (small, large))
    assert len(large.step_guard["first_passes"]) >= 3
    assert large_passes <= small_passes, [sorted(dict(p).items()) for p in large_passes - small_passes]
    keys = ("trees_verified", "nodes_verified", "tokens_accepted")
    assert small.token_ids == ragged.token_ids
    assert [small.tree_stats[k] for k in keys] == [ragged.tree_stats[k] for k in keys], (small.tree_stats,
                                                                                        ragged.tree_stats)
    assert small.tau > 1.3, small.tree_stats
