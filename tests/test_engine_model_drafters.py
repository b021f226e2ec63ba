"""Model drafters inside the real vLLM engine on the demo model (CPU, float32).

Greedy output with ``eagle3`` (the committed trained head) and ``draft_model``
trees equals vLLM without speculation, token for token, at batch sizes 1 and
8, for every policy (``eagle2``, ``talon``, ``deagle``, ``dynatree``, ``c2t``). Two checks that fail if the draft KV or the draft tree attention is wrong:
the chain policy drafts exactly what vLLM's own ``eagle3`` method drafts with
the same head (same tau), and the target drafting for itself is accepted in
full.
"""

from __future__ import annotations

from collections import defaultdict

import pytest

from conftest import HEAD, chat_token_ids, run_engine_job
from kernels.cpu_library import SETTING
from vllm_adaptive_spec.prompts import load_prompts, one_per_category

pytestmark = pytest.mark.engine

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


def _run(tmp_path, demo_model, prompt_ids, spec, pause_pattern=None, **extra):
    """Run ``spec`` on every prompt at batch 8."""
    job = {"model": demo_model, "prompt_token_ids": prompt_ids, "max_tokens": MAX_TOKENS, "max_num_seqs": 8,
           "speculative_config": spec, **extra}
    if pause_pattern:
        job["pause_pattern"] = pause_pattern
    run = run_engine_job(tmp_path, job)
    # A step without drafts (a paused one, a prompt's) is sampled as without speculation.
    assert not pause_pattern or run.draft_free_verifies == 0
    return run


def _serial_then_batched(tmp_path, demo_model, prompt_ids, baseline, spec, pause_pattern=None, **extra):
    """One engine: the first prompts one at a time (batch 1), then all of
    them together (batch 8); greedy output must equal no speculation in both."""
    serial = prompt_ids[:SERIAL_PROMPTS]
    job = {"model": demo_model, "prompt_token_ids": serial + prompt_ids, "max_tokens": MAX_TOKENS,
           "max_num_seqs": 8, "serial_first": len(serial), "speculative_config": spec, **extra}
    if pause_pattern:
        job["pause_pattern"] = pause_pattern
    run = run_engine_job(tmp_path, job)
    assert run.token_ids[: len(serial)] == baseline.token_ids[: len(serial)]
    assert run.token_ids[len(serial):] == baseline.token_ids
    assert run.tree_stats["draft_passes"] > 0
    assert run.tau > 1.5, run.tree_stats  # the trained head really drafts (an untrained one gives about 1.0)
    assert set(run.tree_stats["requests_held"].values()) == {0}, run.tree_stats["requests_held"]
    assert not pause_pattern or run.draft_free_verifies == 0  # as in _run
    return run


def test_eagle3_eagle2_tree_greedy_equals_no_speculation(demo_model, prompt_ids, baseline, tmp_path):
    """Drafting pauses 2 steps in every 5: the head keeps the target's hidden
    states of paused steps and reads them when drafting resumes; a draft
    forward takes at most 12 rows here, so prompts and catch-ups are fed in
    several passes, the oldest rows first; the first drafting step after each
    pause is a probe for 3 requests (the others stay paused). The first
    prompts run twice (alone, then in the batch, the pauses falling
    elsewhere, the second time from the prefix cache): wherever both runs
    draft from the same context, the head's root distribution must be the
    same, caught up or not, read from the cache or not (stale or missing
    draft KV changes it)."""
    spec = adaptive("eagle3", HEAD, 24, policy="eagle2", top_k=4, depth=6)
    run = _serial_then_batched(tmp_path, demo_model, prompt_ids, baseline, spec, pause_pattern=[3, 2, 3],
                               record_roots=True, max_pass_rows=12)
    assert run.split_passes > 0 and run.probes > 0
    assert 0 < run.probe_trees <= 3  # a probe drafts for the requests it was given, no more
    # The repeated prompts hit the prefix cache up to their last full block (two
    # blocks of 128 tokens): the plugin keeps the block vLLM drops for EAGLE, and
    # the roots below read its draft KV from the cache.
    assert run.metrics["vllm:prefix_cache_hits"] >= 2 * 128, run.metrics
    compared, caught_up, _ = _roots_agree(run.roots)
    assert compared >= 20 and caught_up >= 5, (compared, caught_up)


@pytest.mark.parametrize("path", ["native", "torch"])
def test_either_cpu_tree_attention_keeps_greedy_output(path, demo_model, prompt_ids, baseline, tmp_path):
    """The target's verification and the head's tree passes on the native
    CPU tree attention, then on the torch path (the one a machine without a
    compiler takes), each forced by its setting: greedy output unchanged."""
    spec = adaptive("eagle3", HEAD, 12, policy="eagle2", top_k=3, depth=4)
    job = {"model": demo_model, "prompt_token_ids": prompt_ids, "max_tokens": MAX_TOKENS, "max_num_seqs": 8,
           "speculative_config": spec}
    run = run_engine_job(tmp_path, job, env={SETTING: path})
    assert run.token_ids == baseline.token_ids
    assert run.tree_stats["draft_passes"] > 0 and run.tau > 1.5, run.tree_stats


def _roots_agree(recorded) -> tuple[int, int, int]:
    """Check that roots drafted from the same context (``record_roots``)
    agree, whichever pass gave them; how many pairs were compared, and of
    them how many had one side caught up, or one side padded and the other not."""
    roots = defaultdict(list)
    for key, tokens, probs, caught_up, padded in recorded:
        roots[key].append((tokens, probs, caught_up, padded))
    compared = caught_up = mixed = 0
    for (tokens, probs, first_caught_up, first_padded), *others in roots.values():
        for other_tokens, other_probs, other_caught_up, other_padded in others:
            assert other_probs[0] == pytest.approx(probs[0], abs=1e-3)
            tied = probs[0] - probs[1] < 1e-3
            assert other_tokens[0] == tokens[0] or tied, (tokens, probs, other_tokens, other_probs)
            compared += 1
            caught_up += other_caught_up or first_caught_up
            mixed += other_padded != first_padded
    return compared, caught_up, mixed


def test_eagle3_requests_beyond_the_stash_bound_give_up_the_head(demo_model, prompt_ids, baseline, tmp_path):
    """Drafting pauses 8 steps in every 9 and the kept rows are bounded to
    40 (a pause of the batch of 8 keeps 64): the requests keeping the most
    give their rows up and are never drafted by the head again (no pass is
    run over them while paused), the others still draft; the output is the
    target's, and nothing is left behind."""
    spec = adaptive("eagle3", HEAD, 24, policy="eagle2", top_k=4, depth=6)
    row_bytes = 3 * 576 * 4 + 8  # three float32 hidden states of the demo model and the token
    run = _run(tmp_path, demo_model, prompt_ids, spec, pause_pattern=[1, 8], stash_bytes=40 * row_bytes)
    assert run.token_ids == baseline.token_ids
    assert run.stash_drops > 0 and run.paused_passes == 0
    assert run.tree_stats["trees_verified"] > 0
    assert set(run.tree_stats["requests_held"].values()) == {0}, run.tree_stats["requests_held"]


@pytest.mark.parametrize(
    "policy, settings",
    [
        ("talon", {"mu": 0.03}),
        ("deagle", {"top_k": 4, "depth": 12}),
        ("dynatree", {"window": 2}),  # history tuning moves D_0 and tau_h within the run
        ("c2t", {"top_k": 4, "max_depth": 6}),  # the head's shipped classifier
    ],
)
def test_adaptive_policies_greedy_equal_no_speculation(policy, settings, demo_model, prompt_ids, baseline, tmp_path):
    spec = adaptive("eagle3", HEAD, 24, policy=policy, **settings)
    _serial_then_batched(tmp_path, demo_model, prompt_ids, baseline, spec)


@pytest.mark.parametrize("datastore", ["off", "shared"])
def test_hybrid_greedy_equals_no_speculation(datastore, demo_model, prompt_ids, baseline, tmp_path):
    """The head's eagle2 tree merged with the retrieval trie (Talon's hybrid);
    the model pauses 2 steps of 5 (as the load budget pauses it when its
    passes do not pay): the retrieval trie drafts then, and the head alone
    for the requests the trie leaves without a tree (the fill). Without the
    shared datastore it runs on the device's path: the tensor matcher's
    children, uniform steps with the layers at fixed capacity (``step_shape:
    uniform``), nothing read back until the trees, and steady steps' first
    passes padded to the step's width; their roots must equal those of ragged passes (catch-ups,
    prompts) from the same context. Every forward there is also padded to a
    multiple of 8 rows through the head's persistent buffers, as a CUDA
    graph's capture size pads it. With the datastore of finished outputs
    (the trie matcher's), the layers are ragged."""
    device_path = {"matcher": "tensors", "step_shape": "uniform"} if datastore == "off" else {}
    graph_padding = {"pad_draft_passes": 8} if datastore == "off" else {}
    spec = adaptive("hybrid", HEAD, 24, policy="eagle2", top_k=4, depth=6, datastore=datastore, **device_path)
    run = _serial_then_batched(tmp_path, demo_model, prompt_ids, baseline, spec, [3, 2], record_roots=True,
                               **graph_padding)
    assert (datastore == "shared") or run.padded_draft_passes > 0
    assert (run.tree_stats["datastore_tokens"] > 0) == (datastore == "shared")
    assert run.tree_stats["paused_trees"] > 0 and run.tree_stats["fill_trees"] > 0
    compared, _, mixed = _roots_agree(run.roots)
    padded = sum(padded for *_, padded in run.roots)
    assert (padded > 0) == (datastore == "off"), padded
    assert datastore == "shared" or (compared >= 15 and mixed >= 5), (compared, mixed)


def test_eagle3_chain_matches_native_eagle3(demo_model, prompt_ids, baseline, tmp_path):
    ours = _run(tmp_path / "ours", demo_model, prompt_ids, adaptive("eagle3", HEAD, 4, policy="chain"))
    native = _run(tmp_path / "native", demo_model, prompt_ids,
                  {"method": "eagle3", "model": HEAD, "num_speculative_tokens": 4})
    assert ours.token_ids == baseline.token_ids
    assert native.token_ids == baseline.token_ids
    assert abs(ours.tau - native.tau) <= 0.03 * native.tau, (ours.tau, native.tau)


def test_draft_model_tree_greedy_equals_no_speculation(demo_model, prompt_ids, baseline, tmp_path):
    """Batch 8 under the default adaptive load budget (batch 1 is covered by the
    eagle3 test: both drafters share the draft backend)."""
    from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm

    draft = str(ensure_draft_lm(layers=4, minutes=0))
    spec = adaptive("draft_model", draft, 16, policy="eagle2", top_k=4, depth=4, load_budget="adaptive")
    run = _run(tmp_path, demo_model, prompt_ids, spec)
    assert run.token_ids == baseline.token_ids
    assert run.tree_stats["draft_passes"] > 0


def test_target_drafting_for_itself_is_accepted_in_full(demo_model, prompt_ids, baseline, tmp_path):
    """Drafting pauses 2 steps in every 3 (as the load budget pauses when
    drafting does not pay): the draft model skips its passes meanwhile and
    catches up on resume, in passes of at most 12 rows here (the batch's
    catch-ups and prompts take several); without a complete draft KV its
    drafts would stop matching the target. The first 5 prompts (each draft
    pass costs a target pass here)."""
    run = _run(tmp_path, demo_model, prompt_ids[:5], adaptive("draft_model", demo_model, 4, policy="chain"),
               pause_pattern=[1, 2], max_pass_rows=12)
    assert run.token_ids == baseline.token_ids[:5]
    assert run.split_passes > 0
    assert run.paused_passes == 0  # a paused draft LM runs no pass; it catches up when drafting resumes
    stats = run.tree_stats
    assert 0.2 < stats["drafting_share"] < 0.5, stats
    assert stats["tokens_accepted"] >= 0.97 * stats["nodes_verified"], stats


def test_a_draft_lms_padded_first_pass_keeps_its_draft_kv_whole(demo_model, prompt_ids, baseline, tmp_path):
    """The target drafting for itself in uniform steps, the layers at fixed
    capacity (``step_shape: uniform``): steady steps' first passes are padded to the
    step's width plus the token after the chain, and every forward to a
    multiple of 8 rows (a graph's capture size); a padding row that wrote
    KV, or a root read from the wrong row, would make its drafts stop
    matching the target."""
    spec = adaptive("draft_model", demo_model, 4, policy="chain", step_shape="uniform")
    run = _run(tmp_path, demo_model, prompt_ids[:5], spec, record_roots=True, pad_draft_passes=8)
    assert run.token_ids == baseline.token_ids[:5]
    assert sum(padded for *_, padded in run.roots) > 0 and run.padded_draft_passes > 0
    stats = run.tree_stats
    assert stats["tokens_accepted"] >= 0.97 * stats["nodes_verified"], stats
