"""``vllm serve`` with trees under load and faults (a CI-sized run of
``benchmarks/serve_load.py``): 32 requests, 16 at a time, mixing every
sampling option the benchmark sends, streamed and not, with clients that
disconnect mid-stream, deliberately bad requests and a KV cache so small
that vLLM preempts; the same requests without speculation are the
reference (a server whose KV cache holds them all, so it answers sooner).
Each server's worker runs in its engine core process (vLLM's ``uni``
executor): one vLLM import fewer to start; the tensor-parallel tests
cover the plugin in vLLM's worker processes."""

from __future__ import annotations

import pytest

from benchmarks import serve_load
from benchmarks.serving import workload
from conftest import REGISTERED


pytestmark = pytest.mark.engine


def test_server_loses_nothing_and_changes_no_greedy_answer(demo_model, tmp_path):
    """Both servers up, taking turns on two blocks of the workload; the
    speculative server with chunked prefill, as vLLM serves by default (the
    reference without: vLLM 0.32 alone fails a chunked seeded prompt on the
    CPU)."""
    # Every drafted node verified (the default adaptive budget pauses most trees under this load on a CPU).
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 8,
            "tree": {"drafter": "retrieval", "load_budget": "fixed"}}
    # KV for one full-length sequence, the smallest vLLM starts with, in blocks of 32 tokens (a request
    # needs a new block 4x as often as with the CPU's default 128): the speculative server preempts.
    report = serve_load.compare(serve_load.ServeLoadConfig(
        demo_model, {"retrieval": spec}, tmp_path, requests=32, concurrency=16, seed=62, max_model_len=512,
        kv_sequences=1, dtype="float32", max_tokens_cap=48, blocks=2, chunked_spec=True, warmup=2,
        reference_kv_sequences=16, block_size=32, extra_args=["--distributed-executor-backend", "uni"]))
    jobs = workload.workload(32, 62, 512, demo_model, 48)
    kinds = {job.kind for job in jobs}
    assert kinds == {*workload.MIX, "greedy"}, kinds
    assert any(job.disconnect_after for job in jobs) and any(job.stream for job in jobs)
    for label, summary in report["servers"].items():
        assert summary["requests"] == 32 and summary["alive"], label
        assert summary["lost"] == [] and summary["server_errors"] == [] and summary["incomplete"] == [], summary
        assert summary["bad_requests_accepted"] == [], summary
        assert summary["warmup_requests"] == 2 and summary["memory_gib_warm"] > 0, summary
    spec_side = report["servers"]["retrieval"]
    assert spec_side["counters"].get("vllm:num_preemptions_total", 0) > 0, "the KV cache was never short"
    # Trees were verified all along (64 drafting steps; this seed preempted twice).
    assert spec_side["counters"].get("vllm:spec_decode_num_drafts_total", 0) >= 40, spec_side["counters"]
    assert spec_side["counters"].get("vllm:spec_decode_num_accepted_tokens_total", 0) > 0
    greedy = report["greedy"]["retrieval"]
    assert greedy["compared"] >= 15 and greedy["differ"] == [] and greedy["status_differs"] == [], greedy
    for rank in spec_side["tree_stats"]:
        assert set(rank["requests_held"].values()) == {0}, rank["requests_held"]
    # Structured and penalised requests are speculated too, and counted by kind.
    kinds = spec_side["tree_stats"][0]["drafted_by_kind"]
    assert kinds["plain"]["drafted"] > 0 and sum(c["requests"] for c in kinds.values()) >= 20, kinds
    # Requests that switched speculation off got no tree and no grammar-forced draft.
    assert kinds["opted_out"]["drafted"] == kinds["opted_out"]["forced"] == 0, kinds
    assert "requests that received trees: " in (tmp_path / "serve_load.md").read_text()
    assert len(report["ratios"]["retrieval"]["blocks"]) == 2
    assert 0 < spec_side["api_server_gib_end"] < spec_side["memory_gib_end"], spec_side
    # vLLM loads the plugin in the engine core process it spawns.
    log = (tmp_path / "server_retrieval.log").read_text()
    assert "EngineCore" in {name for name, _ in REGISTERED.findall(log)}, log[-3000:]
