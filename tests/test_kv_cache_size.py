"""The KV cache size every engine of the project asks for: its arithmetic, and
an engine started with it serving max_num_seqs requests of max_model_len
tokens without preemption."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import chat_token_ids, run_engine_job
from vllm_adaptive_spec import kv_cache_size
from vllm_adaptive_spec.kv_cache_size import MIB, engine_kwargs, fitting_seqs, kv_cache_bytes, model_kv_shape
from vllm_adaptive_spec.prompts import load_prompts


def _config(path: Path, **fields) -> str:
    path.mkdir()
    base = {"num_attention_heads": 8, "hidden_size": 256, "num_hidden_layers": 4, "dtype": "bfloat16"}
    (path / "config.json").write_text(json.dumps({**base, **fields}))
    return str(path)


def test_shape_defaults_follow_the_config(tmp_path):
    shape = model_kv_shape(_config(tmp_path / "m"))
    assert (shape.layers, shape.kv_heads, shape.head_dim, shape.dtype) == (4, 8, 32, "bfloat16")


def test_target_only_arithmetic(tmp_path):
    target = _config(tmp_path / "t", num_key_value_heads=2, head_dim=64)
    size = kv_cache_bytes(target, max_model_len=1000, max_num_seqs=3, dtype="float32", block_size=128)
    token_bytes = 2 * 4 * 2 * 64 * 4  # K and V, 4 layers, 2 KV heads, head dim 64, fp32
    blocks = 3 * (math.ceil(1000 / 128) + 1) + 1  # 9 per request (one of margin) + vLLM's null block
    assert size == math.ceil(blocks * 128 * token_bytes * 1.1 / MIB) * MIB
    assert kv_cache_bytes(target, max_model_len=1000, max_num_seqs=3, block_size=128) * 2 >= size  # bf16: half


def test_meminfo_reads_system_and_node_files(tmp_path):
    system, node = tmp_path / "meminfo", tmp_path / "node_meminfo"
    system.write_text("MemTotal:       24000000 kB\nMemAvailable:   20000000 kB\n")
    node.write_text("Node 0 MemTotal:  9000000 kB\nNode 0 MemFree:  6000000 kB\nNode 0 Active(file):  100 kB\n"
                    "Node 0 Inactive(file):  200 kB\nNode 0 SReclaimable:  300 kB\n")
    assert kv_cache_size._meminfo(str(system), ("MemAvailable",)) == 20000000 * 1024
    keys = ("MemFree", "Active(file)", "Inactive(file)", "SReclaimable")
    assert kv_cache_size._meminfo(str(node), keys) == 6000600 * 1024
    assert kv_cache_size._meminfo(str(tmp_path / "absent"), keys) is None


def test_fitting_seqs_halves_until_the_cache_fits(tmp_path, monkeypatch):
    target = _config(tmp_path / "t", num_key_value_heads=2, head_dim=64)
    one = kv_cache_bytes(target, max_model_len=2048, max_num_seqs=1)
    reserve = 1 << 30

    def machine(system, node):
        monkeypatch.setattr(kv_cache_size, "available_memory", lambda: system)
        monkeypatch.setattr(kv_cache_size, "kv_limit", lambda: node)
        return fitting_seqs(target, 2048, 128, reserve=reserve)

    assert machine(reserve + 20 * one, None) == 16  # the system's memory, less the reserve
    assert machine(100 * reserve, 20 * one) == 16  # vLLM's node limit, however much the system has
    assert machine(0, 20 * one) == 1
    assert machine(None, None) == 128


def test_draft_model_layers_and_tree_scratch_are_counted(tmp_path):
    target = _config(tmp_path / "t", num_key_value_heads=2, head_dim=64, num_hidden_layers=6)
    draft = _config(tmp_path / "d", num_key_value_heads=4, head_dim=32, num_hidden_layers=2)
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 24, "model": draft,
            "tree": {"drafter": "draft_model", "policy": "eagle2", "top_k": 10, "depth": 8}}
    size = kv_cache_bytes(target, max_model_len=512, max_num_seqs=2, dtype="float32", speculative_config=spec,
                          block_size=16)
    token_bytes = 2 * (6 * 2 * 64 + 2 * 4 * 32) * 4  # target and draft layers share the block table
    scratch = 10 * (8 - 1)  # K * (D - 1) nodes fed to the drafter > N = 24
    blocks = 2 * (math.ceil((512 + scratch) / 16) + 1) + 1
    assert size == math.ceil(blocks * 16 * token_bytes * 1.1 / MIB) * MIB
    native = {"method": "draft_model", "model": draft, "num_speculative_tokens": 5}
    blocks = 2 * (math.ceil((512 + 5) / 16) + 1) + 1
    assert kv_cache_bytes(target, max_model_len=512, max_num_seqs=2, dtype="float32", speculative_config=native,
                          block_size=16) == math.ceil(blocks * 16 * token_bytes * 1.1 / MIB) * MIB


def test_no_share_of_memory_in_engine_settings(demo_model):
    kwargs = engine_kwargs(demo_model, "bfloat16", max_model_len=512, max_num_seqs=4)
    assert "gpu_memory_utilization" not in kwargs and kwargs["kv_cache_memory_bytes"] > 0
    with pytest.raises(ValueError, match="dtype must be"):
        kv_cache_bytes(demo_model, max_model_len=512, max_num_seqs=4, dtype="int8")


MAX_MODEL_LEN, MAX_NUM_SEQS, BLOCK_SIZE, PROMPT_LEN = 192, 4, 32, 64


@pytest.mark.engine
def test_engine_serves_full_length_requests_without_preemption(demo_model, demo_tokenizer, tmp_path):
    """``max_num_seqs`` requests that all run to ``max_model_len`` at once,
    with trees (their nodes take lookahead slots; the draft layers' share is
    checked by the arithmetic tests above)."""
    prompts = [p for p in load_prompts() if len(chat_token_ids(demo_tokenizer, p.messages)) >= PROMPT_LEN]
    ids = [chat_token_ids(demo_tokenizer, p.messages)[:PROMPT_LEN] for p in prompts[:MAX_NUM_SEQS]]
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 16, "tree": {"drafter": "retrieval"}}
    run = run_engine_job(
        tmp_path,
        {"model": demo_model, "prompt_token_ids": ids, "max_tokens": MAX_MODEL_LEN - PROMPT_LEN, "ignore_eos": True,
         "max_model_len": MAX_MODEL_LEN, "max_num_seqs": MAX_NUM_SEQS, "block_size": BLOCK_SIZE,
         "speculative_config": spec},
    )
    assert run.finish_reasons == ["length"] * MAX_NUM_SEQS
    assert all(len(t) == MAX_MODEL_LEN - PROMPT_LEN for t in run.token_ids)
    assert run.metrics["vllm:num_preemptions"] == 0
    assert run.metrics["vllm:spec_decode_num_drafts"] > 0
    assert run.num_gpu_blocks >= MAX_NUM_SEQS * math.ceil(MAX_MODEL_LEN / BLOCK_SIZE) + 1
