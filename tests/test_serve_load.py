"""``vllm serve`` with trees under load and faults (a CI-sized run of
``benchmarks/serve_load.py``): 64 requests, 16 at a time, mixing every
sampling option the benchmark sends, streamed and not, with clients that
disconnect mid-stream, deliberately bad requests and a KV cache so small
that vLLM preempts; the same requests without speculation are the
reference."""

from __future__ import annotations

import pytest

from benchmarks import serve_load

pytestmark = pytest.mark.engine


def test_server_loses_nothing_and_changes_no_greedy_answer(demo_model, tmp_path):
    """Both servers up, taking turns on two blocks of the workload; the
    speculative server with chunked prefill, so seeded prompts are chunked
    under the plugin."""
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 12, "tree": {"drafter": "retrieval"}}
    # KV for one full-length sequence: the smallest vLLM starts with, so the speculative server's
    # lookahead slots make it preempt (with two, one run in many saw no preemption at all).
    report = serve_load.compare(demo_model, {"retrieval": spec}, requests=64, concurrency=16, seed=3,
                                max_model_len=1024, kv_sequences=1, dtype="float32", out=tmp_path, max_tokens_cap=48,
                                blocks=2, chunked_spec=True, warmup=2)
    jobs = serve_load.workload(64, 3, 1024, demo_model, 48)
    kinds = {job.kind for job in jobs}
    assert kinds == {*serve_load.MIX, "greedy"}, kinds
    assert any(job.disconnect_after for job in jobs) and any(job.stream for job in jobs)
    for label, summary in report["servers"].items():
        assert summary["requests"] == 64 and summary["alive"], label
        assert summary["lost"] == [] and summary["server_errors"] == [] and summary["incomplete"] == [], summary
        assert summary["bad_requests_accepted"] == [], summary
        assert summary["warmup_requests"] == 2 and summary["memory_gib_warm"] > 0, summary
    spec_side = report["servers"]["retrieval"]
    assert spec_side["counters"].get("vllm:num_preemptions_total", 0) > 0, "the KV cache was never short"
    assert spec_side["counters"].get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0
    greedy = report["greedy"]["retrieval"]
    assert greedy["compared"] >= 25 and greedy["differ"] == [], greedy
    for rank in spec_side["tree_stats"]:
        assert set(rank["requests_held"].values()) == {0}, rank["requests_held"]
    assert len(report["ratios"]["retrieval"]["blocks"]) == 2
    assert 0 < spec_side["api_server_gib_end"] < spec_side["memory_gib_end"], spec_side
