"""The replay's oracle and cost model (``benchmarks/retrieval_calibration.py``)
and the row-cost slope (``benchmarks/row_cost.py``): pure logic, no engine."""

from __future__ import annotations

import json
import random

import pytest

from benchmarks import retrieval_calibration, row_cost

COST = retrieval_calibration.StepCost(step=40.0, row=2.0, tree=1.0)


def _answers(seed: int) -> list[dict]:
    """Answers that repeat their prompts' phrases with changes, so a suffix
    match offers several continuations and not all are right."""
    rng = random.Random(seed)
    answers = []
    for _ in range(6):
        phrases = [[rng.randrange(20) for _ in range(5)] for _ in range(4)]
        prompt = [t for p in phrases for t in p] * 2
        answer = [t for _ in range(3) for t in rng.choice(phrases)[: rng.randrange(2, 6)]]
        answers.append({"prompt": prompt, "answer": answer + [rng.randrange(20) for _ in range(5)]})
    return answers


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_oracle_bounds_every_choice_from_the_same_trie(seed):
    answers = _answers(seed)
    oracle = retrieval_calibration.replay(answers, {}, {"oracle": True}, 16, COST)
    assert oracle["accepted_nodes_share"] == 1.0
    for name, (drafter_params, policy_params) in retrieval_calibration.SETTINGS.items():
        if set(drafter_params) - {"evidence_prior"}:  # another trie (oracle-last-token's is wider)
            continue
        result = retrieval_calibration.replay(answers, drafter_params, policy_params, 16, COST)
        assert result["tau"] <= oracle["tau"] + 1e-9
        assert result["est_speedup_b1"] <= oracle["est_speedup_b1"] + 1e-9


def test_estimated_speedup_charges_rows_and_trees():
    answers = [{"prompt": [1, 2, 3, 4, 5, 6], "answer": [9, 1, 2, 3, 4, 5, 6]}]
    result = retrieval_calibration.replay(answers, {}, {"oracle": True}, 16, COST)
    # Step 1 (prefill) gives 9; step 2 drafts nothing after 9 and commits 1;
    # step 3 drafts 2..6 after its match on 1, all accepted: 7 tokens in 3 steps, 5 rows.
    assert result["steps"] == 2
    assert result["est_speedup_b1"] == pytest.approx(7 * 40.0 / (40.0 + 40.0 + 40.0 + 1.0 + 2.0 * 5))


def test_row_slope_leaves_the_first_row_out():
    points = [(1, 30.0)] + [(rows, 40.0 + 2.5 * rows) for rows in (2, 4, 8, 16)]
    assert row_cost.slope(points) == pytest.approx(2.5)


def test_a_throughput_runs_acceptance_replayed_at_measured_step_costs():
    """Each method's tau over the step of its rows a request (one plus its
    mean drafts, rounded up to a timed count) against a one-row step; rows
    without drafts, or at a batch not timed, are left out."""
    by_batch = {8: {1: 10.0, 3: 11.0, 5: 12.5, 17: 20.0}}
    results = [
        {"method": "eagle3", "batch_size": 8, "tau": 2.0, "spec": {"drafts": 10, "draft_tokens": 40}},
        {"method": "tree", "batch_size": 8, "tau": 3.0, "spec": {"drafts": 10, "draft_tokens": 120}},
        {"method": "none", "batch_size": 8, "spec": {}},
        {"method": "tree", "batch_size": 64, "tau": 3.0, "spec": {"drafts": 10, "draft_tokens": 120}},
    ]
    replay = row_cost.replayed(by_batch, results)
    assert [(r["method"], r["rows"]) for r in replay] == [("eagle3", 5), ("tree", 17)]
    assert replay[0]["speedup"] == pytest.approx(2.0 * 10.0 / 12.5)
    assert replay[1]["speedup"] == pytest.approx(3.0 * 10.0 / 20.0)


def test_the_tool_reports_every_setting_from_stored_answers(tmp_path):
    """``main`` on answers already on disk (no engine): one report entry and
    one markdown section per setting, with the cost it was estimated at."""
    (tmp_path / "greedy_answers_prompts_8.json").write_text(json.dumps(_answers(0)), encoding="utf-8")
    retrieval_calibration.main(["--max-tokens", "8", "--settings", "evidence,oracle", "--row-ms", "3",
                                "--out", str(tmp_path)])
    report = json.loads((tmp_path / "retrieval_calibration.json").read_text(encoding="utf-8"))
    assert report["cost_ms"] == {"step": 46.6, "row": 3.0, "tree": 1.6, "branch": 7.8}
    assert report["oracle"]["est_speedup_b1"] > report["evidence"]["est_speedup_b1"]
    text = (tmp_path / "retrieval_calibration.md").read_text(encoding="utf-8")
    assert "### evidence:" in text and "### oracle:" in text and "est. b1" in text


def test_vllms_ngram_drafter_replays_as_vllm_matches():
    """vLLM's own n-gram matching, driven by the chain replay: after 9 nothing
    matches (one token, 1); after 1 it proposes 2 3 4 5 from the prompt, all
    accepted, and the answer is done: 6 tokens, 5 of them over 2 steps."""
    answers = [{"prompt": [1, 2, 3, 4, 5], "answer": [9, 1, 2, 3, 4, 5]}]
    result = retrieval_calibration.replay_chains(answers, COST, retrieval_calibration.NgramChains())
    assert result["steps"] == 2
    assert result["tau"] == pytest.approx(2.5)
    assert result["accepted_nodes_share"] == 1.0


def test_the_replayed_load_budget_learns_the_costs_it_is_fed():
    """The ``load-budget`` setting feeds the engine's budget the replayed steps'
    costed times: where a node costs as much as ten steps it soon drafts
    almost nothing (its first steps, before the fit is trusted, draft the
    confident nodes), while the fixed budget keeps drafting; where nodes are
    nearly free it drafts about what the fixed budget drafts."""
    answers = _answers(1) * 3
    dear = retrieval_calibration.StepCost(step=40.0, row=400.0, tree=1.0)
    cheap = retrieval_calibration.StepCost(step=40.0, row=0.01, tree=0.0)
    budget, fixed = ({}, {"load_budget": True}), ({}, {})
    result = {(name, c.row): retrieval_calibration.replay(answers, *params, 16, c)
              for name, params in (("budget", budget), ("fixed", fixed)) for c in (dear, cheap)}
    assert result["fixed", 400.0]["est_speedup_b1"] < 0.5
    assert result["budget", 400.0]["est_speedup_b1"] > 0.5
    assert result["budget", 400.0]["nodes_per_step"] < 0.1 * result["fixed", 400.0]["nodes_per_step"]
    assert result["budget", 0.01]["nodes_per_step"] > 0.5 * result["fixed", 0.01]["nodes_per_step"]
