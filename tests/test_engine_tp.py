"""Tensor parallelism: adaptive_tree with ``tensor_parallel_size=2`` on the CPU.

A small Llama whose 4 query and 2 KV heads split over two ranks (random
weights, the demo model's tokenizer, an LM head scaled so that greedy choices
are not near-ties). Greedy output with the retrieval drafter (every drafted
node verified) and with a draft model (the same small model drafting for
itself, under the default adaptive load budget, whose pauses and tree sizes
follow measured times) equals the same engine without speculation, and
every rank verified the same trees and ran the same draft passes, since
they act on rank 0's clock readings.
"""

from __future__ import annotations

import shutil

import pytest

from conftest import REGISTERED, run_engine_job

pytestmark = pytest.mark.engine

MAX_TOKENS = 20
# vLLM binds each CPU rank's threads to a NUMA node of its own by default;
# these machines have one node, so the ranks share the cores, a thread each.
TP_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": "1"}
PROMPTS = [[1, 504, 3300, 314, 260, 1345, 30], [1, 2683, 339, 253, 1664, 282, 5019, 30, 1116],
           [1, 19161, 1489, 4193, 12], [1, 504, 1837, 3300, 12]]


@pytest.fixture(scope="module")
def tiny_llama(demo_model, tmp_path_factory) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    directory = tmp_path_factory.mktemp("tiny-llama")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, torch_dtype="float32")
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.normal_(0.0, 1.0)  # logits a few units apart, not near-ties
    model.save_pretrained(directory, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{demo_model}/{name}", directory / name)
    return str(directory)


def _job(model: str, spec: dict | None = None) -> dict:
    job = {"model": model, "prompt_token_ids": PROMPTS, "max_tokens": MAX_TOKENS, "max_num_seqs": 4,
           "ignore_eos": True, "tensor_parallel_size": 2}
    return job if spec is None else {**job, "speculative_config": spec}


@pytest.fixture(scope="module")
def baseline(tiny_llama, tmp_path_factory):
    return run_engine_job(tmp_path_factory.mktemp("tp-plain"), _job(tiny_llama), TP_ENV)


@pytest.mark.parametrize("drafter", ["retrieval", "draft_model"])
def test_tensor_parallel_greedy_equals_no_speculation(drafter, tiny_llama, baseline, tmp_path):
    if drafter == "retrieval":
        tree = {"drafter": drafter, "policy": "retrieval", "load_budget": "fixed"}
    else:
        tree = {"drafter": drafter, "policy": "eagle2", "top_k": 2, "depth": 4}
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 16, "tree": tree}
    if drafter == "draft_model":
        spec["model"] = tiny_llama
    run = run_engine_job(tmp_path, _job(tiny_llama, spec), TP_ENV)
    assert run.token_ids == baseline.token_ids
    # vLLM loads the plugin in each worker process it spawns.
    assert {name for name, _ in REGISTERED.findall(run.log)} >= {"VllmWorker-0", "VllmWorker-1"}, run.log[-3000:]
    assert len(run.tree_stats_per_rank) == 2
    first, second = run.tree_stats_per_rank
    assert first["trees_verified"] > 0 and first["tokens_accepted"] > 0, first
    if drafter == "draft_model":
        assert first["draft_passes"] > 0, first
    for key in ("trees_verified", "nodes_verified", "tokens_accepted", "paused", "draft_passes"):
        assert first[key] == second[key], (key, first[key], second[key])
