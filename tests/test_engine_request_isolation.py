"""What one request can do to the others (``adapter/request_options``), on
the real engine: a failure in the plugin's per-request work costs trees,
never the engine, and a request that switches speculation off gets none
while the rest of the batch keeps drafting; greedy output equals no
speculation token for token throughout."""

from __future__ import annotations

import pytest
from test_engine_structured import KINDS, QUESTIONS
from test_engine_tree import TREE

from conftest import chat_token_ids, run_engine_job
from vllm_adaptive_spec.prompts import load_prompts

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
FAIL_FOR = {"drafting": 0, "grammar_cut": 2, "grammar_forcing": 3, "tree_rows": None}
OFF = (1, 5)  # the prompts that switch speculation off


@pytest.fixture(scope="module")
def job(demo_model, demo_tokenizer):
    """Two prompts whose answers repeat the input (the retrieval tree drafts
    for them from the first steps), then the structured-output test's JSON,
    regex and choice requests."""
    copying = [p for p in load_prompts() if p.repeats_input][:2]
    prompts = [chat_token_ids(demo_tokenizer, p.messages) for p in copying]
    prompts += [chat_token_ids(demo_tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    extras = {str(2 + i): {"structured_outputs": kind} for i, kind in enumerate(KINDS[2:])}
    return {"model": demo_model, "prompt_token_ids": prompts, "max_tokens": MAX_TOKENS, "max_num_seqs": 8,
            "extras": extras}


@pytest.fixture(scope="module")
def baseline(job, tmp_path_factory):
    return run_engine_job(tmp_path_factory.mktemp("isolation-none"), job)


def test_failures_in_per_request_work_cost_trees_not_the_engine(job, baseline, tmp_path):
    """The retrieval drafter raises for request 0's index, the scheduler's
    grammar walk for request 2's tree, its grammar forcing for request 3,
    and the verifier's tree rows on every third step with trees: every
    request is answered as without speculation, the others' trees are
    verified, and each failure happened."""
    fail_for = {place: 0 if index is None else index for place, index in FAIL_FOR.items()}
    run = run_engine_job(tmp_path, {**job, "speculative_config": TREE, "fail_for": fail_for})
    assert run.token_ids == baseline.token_ids
    assert all(run.injected_failures.get(place, 0) >= 1 for place in FAIL_FOR), run.injected_failures
    assert run.tree_stats["tokens_accepted"] >= 30, run.tree_stats


def test_a_request_can_switch_speculation_off(job, baseline, tmp_path):
    """``extra_args={"speculation": "off"}`` (the API's ``vllm_xargs``):
    those requests verify no tree and no grammar-forced draft, as vLLM's
    per-request report shows (no drafts), while the others draft and
    accept; every answer is the one without speculation."""
    extras = {**job["extras"], **{str(i): {**job["extras"].get(str(i), {}), "extra_args": {"speculation": "off"}}
                                  for i in OFF}}
    run = run_engine_job(tmp_path, {**job, "extras": extras, "speculative_config": TREE,
                                    "per_request_metrics": "summary"})
    assert run.token_ids == baseline.token_ids
    reports = run.spec_decode_metrics
    assert all(reports[i]["num_draft_tokens"] == 0 and reports[i]["num_spec_steps"] == 0 for i in OFF), reports
    drafted = [report for i, report in enumerate(reports) if i not in OFF and report["num_spec_steps"]]
    assert len(drafted) >= 3 and sum(r["num_accepted_draft_tokens"] for r in drafted) >= 30, reports
    # The reports add up to /metrics' totals: nodes verified, tokens accepted, tree steps.
    totals = {"num_draft_tokens": "vllm:spec_decode_num_draft_tokens",
              "num_accepted_draft_tokens": "vllm:spec_decode_num_accepted_tokens",
              "num_spec_steps": "vllm:spec_decode_num_drafts"}
    for field, counter in totals.items():
        assert sum(report[field] for report in reports) == run.metrics[counter], (field, reports, run.metrics)
