"""Model drafters inside the real vLLM engine on the demo model (CPU, float32).

Greedy output with ``eagle3`` (the committed trained head) and ``draft_model``
trees equals vLLM without speculation, token for token, at batch sizes 1 and
8. Two checks that fail if the draft KV or the draft tree attention is wrong:
the chain policy drafts exactly what vLLM's own ``eagle3`` method drafts with
the same head (same tau), and the target drafting for itself is accepted in
full.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from conftest import chat_token_ids, run_engine_job
from vllm_adaptive_spec.prompts import load_prompts, one_per_category

pytestmark = pytest.mark.engine

HEAD = str(Path(__file__).resolve().parent.parent / "heads" / "smollm2-135m-eagle3")
MAX_TOKENS = 28
# Batch size 1 runs the prompts one after the other: the first few are enough.
SERIAL_PROMPTS = 3


def adaptive(drafter: str, model: str, budget: int, **tree) -> dict:
    """A model-drafter tree; the load budget is fixed (every drafted node is
    verified) unless a test asks for the default adaptive one."""
    return {"method": "adaptive_tree", "num_speculative_tokens": budget, "model": model,
            "tree": {"drafter": drafter, "load_budget": "fixed", **tree}}


@pytest.fixture(scope="module")
def prompt_ids(demo_tokenizer):
    prompts = one_per_category(load_prompts())
    prompts.append(next(p for p in load_prompts() if p.repeats_input and p.category == "code"))
    return [chat_token_ids(demo_tokenizer, p.messages) for p in prompts]


@pytest.fixture(scope="module")
def baseline(demo_model, prompt_ids, tmp_path_factory):
    return run_engine_job(
        tmp_path_factory.mktemp("baseline"),
        {"model": demo_model, "prompt_token_ids": prompt_ids, "max_tokens": MAX_TOKENS, "max_num_seqs": 8},
    )


def _run(tmp_path, demo_model, prompt_ids, spec, batch_size, pause_pattern=None):
    """Run ``spec``; batch size 1 on the first ``SERIAL_PROMPTS`` prompts only."""
    ids = prompt_ids[:SERIAL_PROMPTS] if batch_size == 1 else prompt_ids
    job = {"model": demo_model, "prompt_token_ids": ids, "max_tokens": MAX_TOKENS, "max_num_seqs": batch_size,
           "speculative_config": spec}
    if pause_pattern:
        job["pause_pattern"] = pause_pattern
    return run_engine_job(tmp_path, job)


def _expected(baseline, run):
    return baseline.token_ids[: len(run.token_ids)]


@pytest.mark.parametrize("batch_size", [1, 8])
def test_eagle3_eagle2_tree_greedy_equals_no_speculation(batch_size, demo_model, prompt_ids, baseline, tmp_path):
    """At batch 8 drafting pauses 2 steps in every 5 (the head keeps reading
    the target's hidden states meanwhile)."""
    run = _run(tmp_path, demo_model, prompt_ids, adaptive("eagle3", HEAD, 24, policy="eagle2", top_k=4, depth=6),
               batch_size, pause_pattern=[3, 2] if batch_size > 1 else None)
    assert run.token_ids == _expected(baseline, run)
    assert run.tree_stats["draft_passes"] > 0
    assert run.tau > 1.5  # the trained head really drafts (an untrained one gives about 1.0)


def test_eagle3_chain_matches_native_eagle3(demo_model, prompt_ids, baseline, tmp_path):
    ours = _run(tmp_path / "ours", demo_model, prompt_ids, adaptive("eagle3", HEAD, 4, policy="chain"), 8)
    native = _run(tmp_path / "native", demo_model, prompt_ids,
                  {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 4}, 8)
    assert ours.token_ids == baseline.token_ids
    assert native.token_ids == baseline.token_ids
    assert abs(ours.tau - native.tau) <= 0.03 * native.tau, (ours.tau, native.tau)


def test_draft_model_tree_greedy_equals_no_speculation(demo_model, prompt_ids, baseline, tmp_path):
    """Batch 8 under the default adaptive load budget (batch 1 is covered by the
    eagle3 test: both drafters share the draft backend)."""
    from vllm_adaptive_spec.training.draft_lm import ensure_draft_lm

    draft = str(ensure_draft_lm(layers=4, minutes=0))
    spec = adaptive("draft_model", draft, 16, policy="eagle2", top_k=4, depth=4, load_budget="adaptive")
    run = _run(tmp_path, demo_model, prompt_ids, spec, 8)
    assert run.token_ids == _expected(baseline, run)
    assert run.tree_stats["draft_passes"] > 0


def test_target_drafting_for_itself_is_accepted_in_full(demo_model, prompt_ids, baseline, tmp_path):
    """Drafting pauses 2 steps in every 3 (as the load budget pauses when
    drafting does not pay): the draft model skips its passes meanwhile and
    catches up on resume; without a complete draft KV its drafts would stop
    matching the target."""
    run = _run(tmp_path, demo_model, prompt_ids, adaptive("draft_model", demo_model, 4, policy="chain"), 8,
               pause_pattern=[1, 2])
    assert run.token_ids == baseline.token_ids
    stats = run.tree_stats
    assert 0.2 < stats["drafting_share"] < 0.5, stats
    assert stats["tokens_accepted"] >= 0.97 * stats["nodes_verified"], stats
