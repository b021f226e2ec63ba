"""Structured output with trees on the real engine: JSON
schema, regex and choice requests get trees, the scheduler removing the
nodes their grammar forbids and masking each other node with the grammar's
state after its path (``adapter/tree_scheduler``);
greedy output equals no speculation token for token at batch 1 and 8, and
every answer that ended parses against its schema or matches its regex;
sampling under a grammar keeps the target's law; a step without a tree
drafts what the grammar forces."""

from __future__ import annotations

import json
import re
from collections import Counter

import pytest
from test_engine_tree import SAMPLED_TREES, _homogeneity_pvalue

from conftest import HEAD, chat_token_ids, run_engine_job

pytestmark = pytest.mark.engine

MAX_TOKENS = 40
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "city": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "city", "age"],
}
PHONE = r"\(\d{3}\) \d{3}-\d{4}"
PEOPLE = ["Maria Lopez, 34, lives in Madrid", "Tom Baker, 58, lives in Leeds"]
QUESTIONS = [
    *(f"Return a JSON object with the keys name, city and age for: {p}." for p in PEOPLE),
    "Write the phone number (555) 010-4477 in the form (555) 010-4477.",
    "Give a US phone number in the form (212) 555-0199.",
    "Is the review 'great food, slow service' positive, negative or mixed?",
    "Is the review 'the best pizza in town' positive, negative or mixed?",
]
OUTPUTS = [{"json": SCHEMA}] * 2 + [{"regex": PHONE}] * 2 + [{"choice": ["positive", "negative", "mixed"]}] * 2
KINDS = OUTPUTS[:2] + OUTPUTS  # the first two alone (batch 1), then all of them (batch 8)


@pytest.fixture(scope="module")
def job(demo_model, demo_tokenizer):
    prompts = [chat_token_ids(demo_tokenizer, [{"role": "user", "content": q}]) for q in QUESTIONS]
    return {"model": demo_model, "prompt_token_ids": prompts[:2] + prompts, "max_tokens": MAX_TOKENS,
            "max_num_seqs": 8, "serial_first": 2,
            "extras": {str(i): {"structured_outputs": kind} for i, kind in enumerate(KINDS)}}


@pytest.fixture(scope="module")
def baseline(job, tmp_path_factory):
    return run_engine_job(tmp_path_factory.mktemp("structured-none"), job)


def test_a_structured_request_without_trees_drafts_what_its_grammar_forces(job, baseline, tmp_path):
    """``grammar_forcing``: a retrieval drafter that never matches (suffixes
    of 30 tokens) leaves every step without a tree; the structured requests
    then draft their grammar's jump-forward strings (the JSON keys), which
    the target accepts, and greedy output is unchanged."""
    tree = {"drafter": "retrieval", "l_min": 30, "l_max": 30}
    run = run_engine_job(tmp_path, {**job, "speculative_config": {"method": "adaptive_tree",
                                                                   "num_speculative_tokens": 12, "tree": tree}})
    assert run.token_ids == baseline.token_ids
    stats = run.tree_stats
    assert stats["trees_verified"] == 0 and stats["forced_accepted"] >= max(stats["forced_nodes"] / 2, 8), stats
    assert stats["drafted_by_kind"]["structured"]["forced"] >= 4, stats


def answers_hold(run, demo_tokenizer) -> None:
    for tokens, reason, kind in zip(run.token_ids, run.finish_reasons, KINDS):
        text = demo_tokenizer.decode(tokens, skip_special_tokens=True)
        if reason != "stop":
            continue
        if "json" in kind:
            assert set(json.loads(text)) >= {"name", "city", "age"}, text
        elif "regex" in kind:
            assert re.fullmatch(PHONE, text), text
        else:
            assert text in kind["choice"], text


@pytest.mark.parametrize("drafter", ["retrieval", "eagle3"])
def test_structured_requests_get_trees_and_keep_greedy_output(drafter, job, baseline, demo_tokenizer, tmp_path):
    tree = {"drafter": drafter, "load_budget": "fixed"}
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 12, "tree": tree}
    if drafter == "retrieval":  # a JSON-mode server's answers share their form: earlier ones draft later ones
        tree["datastore"] = "shared"
    if drafter == "eagle3":
        spec["model"] = HEAD
        tree.update(policy="eagle2", top_k=3, depth=4)
    run = run_engine_job(tmp_path, {**job, "speculative_config": spec})
    assert run.token_ids == baseline.token_ids
    answers_hold(baseline, demo_tokenizer)
    assert sum(reason == "stop" for reason in run.finish_reasons) >= 8
    steps = sum(len(t) for t in run.token_ids) - run.tree_stats["tokens_accepted"]
    assert run.tree_stats["trees_verified"] >= steps / 2, (run.tree_stats, steps)
    assert run.tau > 1.3, run.tree_stats
    # Nodes the grammar forbids were removed before verification (the scheduler's cut, the worker's subtree).
    assert run.tree_stats["grammar_cut_nodes"] > 0, run.tree_stats
    # Steps without a tree (nothing drafted, or every node cut) drafted their grammar's forced tokens,
    # which greedy decoding always accepts (``grammar_forcing``).


def test_sampling_with_a_grammar_is_unchanged_by_a_tree(demo_model, demo_tokenizer, tmp_path):
    """Temperature 1 under a JSON schema, TALON's hybrid tree (the EAGLE-3
    head and the retrieval trie) drafting every step: each node is verified
    against its parent's grammar row, so the first tokens where the grammar
    leaves a choice keep the law of the masked target without speculation
    (120 seeds without, 90 with; chi-square, alpha = 1e-3 per position; at
    least two positions with a choice)."""
    prompt = chat_token_ids(demo_tokenizer, [{"role": "user", "content": QUESTIONS[0]}])
    grammar = {"structured_outputs": {"json": SCHEMA}}
    job = {"model": demo_model, "prompt_token_ids": [prompt] * 120, "seeds": list(range(120)), "temperature": 1.0,
           "max_tokens": 4, "max_num_seqs": 64, "max_num_batched_tokens": 16384,
           "extras": {str(i): grammar for i in range(120)}}
    plain = run_engine_job(tmp_path / "plain", job)
    spec = {**SAMPLED_TREES["hybrid-talon-6"][0], "num_speculative_tokens": 4}  # a grammar row a node: fewer nodes
    run = run_engine_job(tmp_path / "tree", {**job, "prompt_token_ids": [prompt] * 90,
                                             "seeds": list(range(2000, 2090)), "speculative_config": spec})
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 20, run.metrics
    tested = 0
    for position in range(1, 4):
        a = [t[position] for t in plain.token_ids if len(t) > position]
        b = [t[position] for t in run.token_ids if len(t) > position]
        if sum(count >= 10 for count in Counter(a + b).values()) < 2:
            continue  # the grammar (or the model) leaves no choice here
        pvalue = _homogeneity_pvalue(a, b)
        assert pvalue > 1e-3, f"token {position}: p = {pvalue:.2g}"
        tested += 1
    assert tested >= 2, tested
