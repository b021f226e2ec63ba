"""The uniform step (a CUDA engine's default) run end to end on the CPU
engine, forced on with ``step_shape: uniform``: every decoding request of a
drafting step has ``1 + W`` rows, the trees laid out from the persistent
tree buffers, the width chosen by the load budget over the measured step
shapes, a model drafter's layers in the fixed draft loop with every forward
padded and staged in the draft model's persistent buffers as a graph's
capture size would pad it. Everything the GPU step runs but the capture and
replay of graphs. Greedy output equals vLLM without speculation for every
drafter, and the counters show that each of those parts ran."""

from __future__ import annotations

import pytest

from conftest import HEAD, run_engine_job
from test_engine_model_drafters import MAX_TOKENS, baseline, prompt_ids  # noqa: F401 - the same prompts' baseline

pytestmark = pytest.mark.engine


def _spec(drafter: str, budget: int, model: str | None = None, **tree) -> dict:
    spec = {"method": "adaptive_tree", "num_speculative_tokens": budget,
            "tree": {"drafter": drafter, "step_shape": "uniform", **tree}}
    return spec if model is None else {**spec, "model": model}


def _draft_lm() -> str:
    from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm

    return str(ensure_draft_lm(layers=4, minutes=0))


# name -> (a function giving its speculative config, whether a model drafts)
CASES = {
    "retrieval-trie": (lambda: _spec("retrieval", 16, policy="retrieval", matcher="trie"), False),
    "retrieval-tensors": (lambda: _spec("retrieval", 16, policy="retrieval", matcher="tensors"), False),
    "eagle3-eagle2": (lambda: _spec("eagle3", 16, HEAD, policy="eagle2", top_k=4, depth=6), True),
    "eagle3-talon": (lambda: _spec("eagle3", 12, HEAD, policy="talon", top_k=3), True),
    "eagle3-deagle": (lambda: _spec("eagle3", 24, HEAD, policy="deagle", top_k=4, depth=12), True),
    "draft-lm-eagle2": (lambda: _spec("draft_model", 16, _draft_lm(), policy="eagle2", top_k=4, depth=4), True),
    "hybrid-eagle2": (lambda: _spec("hybrid", 16, HEAD, policy="eagle2", top_k=4, depth=6, matcher="tensors"), True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_uniform_step_keeps_greedy_output_and_runs_its_parts(case, demo_model, prompt_ids, baseline, tmp_path):
    make_spec, model = CASES[case]
    job = {"model": demo_model, "prompt_token_ids": prompt_ids, "max_tokens": MAX_TOKENS, "max_num_seqs": 8,
           "speculative_config": make_spec()}
    # A model drafter drafts 3 steps in 5, as the load budget paused it (on the CPU its passes do not
    # pay), the first paused step a control step: draft-free (the hybrid's trie and its fill draft
    # on the other), it measures the draft-free step the width choice is judged against.
    run = run_engine_job(tmp_path, {**job, "pause_pattern": [3, 2], "paused_controls": True} if model else job)
    assert run.token_ids == baseline.token_ids
    stats = run.tree_stats
    assert stats["trees_verified"] > 0 and stats["uniform_layouts"] > 0, stats
    assert stats["width_choices"] > 0, stats  # the load budget chose widths over measured step shapes
    assert (stats["fill_trees"] > 0) == case.startswith("hybrid"), stats  # the head where the trie has none
    # vLLM counts the padding slots as drafts; the plugin counts only nodes.
    assert run.metrics["vllm:spec_decode_num_draft_tokens"] > stats["nodes_verified"]
    assert stats["tokens_accepted"] == run.metrics["vllm:spec_decode_num_accepted_tokens"]
    assert (stats["padded_draft_passes"] > 0) == model, stats  # forwards staged as a graph's would be
    assert set(stats["requests_held"].values()) == {0}, stats["requests_held"]
