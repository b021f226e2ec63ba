"""vLLM's per-request sampling controls on tree rows, in the real engine on
the demo model (CPU, float32): ``logit_bias``, ``min_p`` and ``bad_words``
keep the law of sampled tokens decided by trees, and a ``min_tokens`` that
binds keeps greedy output token for token."""

from __future__ import annotations

import pytest

from conftest import chat_token_ids, run_engine_job
from test_engine_tree import (  # noqa: F401  (prompts, prompt_ids and sampling_job are fixtures)
    SAMPLED_TREES,
    _homogeneity_pvalue,
    prompt_ids,
    prompts,
    sampling_job,
)

pytestmark = pytest.mark.engine

HYBRID = SAMPLED_TREES["hybrid-talon-6"][0]  # TALON's tree on the EAGLE-3 head and the retrieval trie: drafts every step
UNCONTROLLED, PLAIN, TREE = 200, 200, 100  # seeds: without a control, and per control without and with trees


def _controls(tokenizer) -> dict[str, dict]:
    """Per control, the sampling parameters of its requests, chosen from what
    the sampling job's prompt answers without them (300 seeds): ``Yes`` opens
    1 answer in 6, ``,`` is the commonest 2nd token (1 in 4; ``'s`` and
    ``'ve`` 1 in 20 each) and `` add`` the commonest 3rd (1 in 9, after ``,``
    mostly; `` I`` 1 in 20)."""
    comma, a = (tokenizer.encode(text, add_special_tokens=False)[0] for text in (",", " a"))
    return {
        "logit_bias": {"logit_bias": {str(comma): -100.0, str(a): 4.0}},
        "min_p": {"min_p": 0.2},
        # One-token words, and two-token ones whose first token is the output's
        # (a tree's root row) or the tree path's (its nodes' rows).
        "bad_words": {"bad_words": ["Yes,", ", add", "'s", "'ve", " I"]},
    }


@pytest.fixture(scope="module")
def controlled_runs(sampling_job, demo_tokenizer, tmp_path_factory):
    """One job without speculation (UNCONTROLLED requests without a control,
    then PLAIN with each control) and one with the hybrid tree (TREE with
    each control), all on the sampling job's prompt at temperature 1; per
    control, its requests' tokens without and with trees, then the
    uncontrolled tokens and the tree run."""
    controls = _controls(demo_tokenizer)
    prompt = sampling_job["prompt_token_ids"][0]

    def job(first: int, per_control: int, seed: int, **more) -> dict:
        count = first + per_control * len(controls)
        extras = {str(first + k * per_control + i): params
                  for k, params in enumerate(controls.values()) for i in range(per_control)}
        return {**sampling_job, "prompt_token_ids": [prompt] * count, "seeds": list(range(seed, seed + count)),
                "extras": extras, **more}

    plain = run_engine_job(tmp_path_factory.mktemp("plain"), job(UNCONTROLLED, PLAIN, 3000))
    tree = run_engine_job(tmp_path_factory.mktemp("tree"), job(0, TREE, 4000, speculative_config=HYBRID))
    groups = {name: (plain.token_ids[UNCONTROLLED + k * PLAIN:][:PLAIN], tree.token_ids[k * TREE:][:TREE])
              for k, name in enumerate(controls)}
    return groups, plain.token_ids[:UNCONTROLLED], tree


@pytest.mark.parametrize("control", ["logit_bias", "min_p", "bad_words"])
def test_sampled_tree_rows_keep_the_control(control, controlled_runs):
    """Temperature 1, TALON's hybrid tree drafting on every step, the
    requests of the three controls in one batch: each tree row is processed
    with its request's control (the bad words after the row's own path), so
    the 2nd and 3rd tokens keep the law of the controlled target without
    speculation (200 seeds without, 100 with; chi-square, alpha = 1e-3), and
    the control does change that law (p < 1e-3 against uncontrolled requests
    at one position at least). Tree rows left without the control fail it
    (each of ``apply_row_logit_bias``, ``apply_row_min_p`` and
    ``RowHistories.ban_bad_words`` made a no-op, tried: p = 6e-14, 1e-5 and
    2e-5 at one position)."""
    groups, uncontrolled, run = controlled_runs
    plain, tree = groups[control]
    # Trees on (nearly) every step that decides a token, partly accepted.
    assert run.tree_stats["trees_verified"] >= 1.5 * TREE * len(groups), run.tree_stats
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 30, run.metrics
    changed = [_homogeneity_pvalue([t[p] for t in plain], [t[p] for t in uncontrolled]) for p in (1, 2)]
    assert min(changed) < 1e-3, changed
    for position in (1, 2):
        pvalue = _homogeneity_pvalue([t[position] for t in plain], [t[position] for t in tree])
        assert pvalue > 1e-3, f"token {position}: p = {pvalue:.2g}"


SHORT_ANSWERS = ["Repeat exactly: The cat sat on the mat.", "What is 2 + 2? Answer with a number only.",
                 "What is the capital of France? One word."]
ANSWER_TOKENS = 8  # each short answer's, its EOS the last
MIN_TOKENS = (ANSWER_TOKENS, 20)


def test_min_tokens_that_binds_keeps_greedy_output(demo_model, demo_tokenizer, tmp_path):
    """Greedy, TALON's hybrid tree: three prompts whose answers end (EOS) at
    their 8th token, each without ``min_tokens``, with 8 (binding by one: the
    EOS comes after 7 tokens) and with 20, in one batch. The stop tokens are
    masked on every tree row whose output plus path is still shorter than
    ``min_tokens`` and on no other, so the answers equal no speculation's
    token for token, and those with ``min_tokens`` are longer than those
    without: it binds. Tree rows left unmasked fail it (``RowHistories.mask_min_tokens``
    made a no-op, tried: the answer with 8 ends at its 8th token)."""
    ids = [chat_token_ids(demo_tokenizer, [{"role": "user", "content": q}]) for q in SHORT_ANSWERS]
    per_prompt = 1 + len(MIN_TOKENS)
    job = {"model": demo_model, "prompt_token_ids": [p for p in ids for _ in range(per_prompt)], "max_tokens": 48,
           "max_num_seqs": 16, "extras": {str(per_prompt * i + 1 + k): {"min_tokens": m}
                                          for i in range(len(ids)) for k, m in enumerate(MIN_TOKENS)}}
    plain = run_engine_job(tmp_path / "plain", job)
    run = run_engine_job(tmp_path / "tree", {**job, "speculative_config": HYBRID})
    # Per prompt: the answer without min_tokens ends with EOS at its 8th token, those with m tokens are longer than m.
    lengths = [len(t) for t in plain.token_ids]
    assert all(lengths[i] == ANSWER_TOKENS and all(lengths[i + 1 + k] > m for k, m in enumerate(MIN_TOKENS))
               for i in range(0, len(lengths), per_prompt)), plain.token_ids
    assert plain.finish_reasons[::per_prompt] == ["stop"] * len(ids)
    assert run.token_ids == plain.token_ids
    assert run.metrics["vllm:spec_decode_num_drafts"] > 0
