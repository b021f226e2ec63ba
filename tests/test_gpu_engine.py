"""adaptive_tree in the real vLLM engine on a GPU (skipped without CUDA).

Every drafter, in both CUDA attention backends with tree paths, with vLLM's
compilation and CUDA graphs on (FULL graphs for steps without a branching
tree, draft-free steps on the one-row-a-request FULL graphs the plugin
captures, PIECEWISE for the others), drafting full trees every step (the fixed
load budget): greedy output equals vLLM without speculation on the same
backend, dtype and model runner (V1, the one the plugin runs on), one engine
running 4 prompts one at a time (batch 1), then 32 together (batch 32).
vLLM's GPU kernels are not batch-invariant, so equal means up to the
target's own near-ties (``tests/greedy_ties.py``): every answer equals the
reference or first departs from it where the reference's two tokens lie
within ``TIES`` of each other, and most answers are equal outright.
``TRITON_ATTN`` runs in float32, ``FLASH_ATTN`` (FlashAttention 3: 16-bit
only) in bfloat16. Sampling at temperature 1 keeps the target's law.
The project's Triton kernels are tested on CUDA tensors by ``tests/kernels``
(they use CUDA wherever it is present).

Run on a GPU machine with ``python -m pytest -m gpu tests/test_gpu_engine.py``.
"""

from __future__ import annotations

import pytest
import torch

from conftest import HEAD, chat_token_ids, run_engine_job
from greedy_ties import tie_problems
from test_engine_tree import SAMPLED_TREES, _homogeneity_pvalue
from vllm_adaptive_spec.prompts import load_prompts

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.engine,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

MAX_TOKENS = 64
SERIAL_PROMPTS = 4
BATCH = 32
DTYPES = {"TRITON_ATTN": "float32", "FLASH_ATTN": "bfloat16"}
# The largest gap between the reference's logprobs of its token and of the
# speculative answer's at their first difference: float32 (vLLM's Triton
# attention multiplies in TF32, the tree kernel in full float32) and bfloat16.
TIES = {"float32": 0.1, "bfloat16": 0.5}
MIN_EXACT = 0.75
# vLLM runs its V2 model runner without speculation and the V1 runner with the
# plugin; the reference runs on V1 too, so only speculation differs.
V1_RUNNER = {"VLLM_USE_V2_MODEL_RUNNER": "0"}


def adaptive(drafter: str, budget: int, model: str | None = None, **tree) -> dict:
    spec = {"method": "adaptive_tree", "num_speculative_tokens": budget,
            "tree": {"drafter": drafter, "load_budget": "fixed", **tree}}
    return spec if model is None else {**spec, "model": model}


def _draft_lm() -> str:
    from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm

    return str(ensure_draft_lm(layers=4, minutes=0))


# name -> a function giving the speculative config (the draft LM is built on first use)
CONFIGS = {
    "retrieval": lambda: adaptive("retrieval", 64),
    "eagle3-eagle2": lambda: adaptive("eagle3", 64, HEAD, policy="eagle2", top_k=4, depth=8),
    "eagle3-talon": lambda: adaptive("eagle3", 64, HEAD, policy="talon"),
    "eagle3-c2t": lambda: adaptive("eagle3", 64, HEAD, policy="c2t", top_k=4, max_depth=8),
    "draft_model": lambda: adaptive("draft_model", 32, _draft_lm(), policy="eagle2", top_k=4, depth=6),
    "hybrid": lambda: adaptive("hybrid", 64, HEAD, policy="eagle2", top_k=4, depth=8, datastore="shared"),
}


@pytest.fixture(scope="module")
def prompt_ids(demo_tokenizer):
    return [chat_token_ids(demo_tokenizer, p.messages) for p in load_prompts()[:BATCH]]


def _job(demo_model, prompt_ids, backend, spec=None, **extra) -> dict:
    serial = prompt_ids[:SERIAL_PROMPTS]
    job = {"model": demo_model, "prompt_token_ids": serial + prompt_ids, "serial_first": len(serial),
           "max_tokens": MAX_TOKENS, "max_num_seqs": BATCH, "dtype": DTYPES[backend],
           "attention_backend": backend, **extra}
    return job if spec is None else {**job, "speculative_config": spec}


@pytest.fixture(scope="module")
def baseline(demo_model, prompt_ids, tmp_path_factory):
    """vLLM without speculation on one backend, run when a test first needs it
    (so a process running one backend's tests starts no engine for the other)."""
    runs: dict[str, object] = {}

    def run(backend: str):
        if backend not in runs:
            runs[backend] = run_engine_job(tmp_path_factory.mktemp(f"plain-{backend}"),
                                           _job(demo_model, prompt_ids, backend, logprobs=5), env=V1_RUNNER)
        return runs[backend]

    return run


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("backend", list(DTYPES))
def test_greedy_equals_no_speculation_on_gpu(backend, config, demo_model, prompt_ids, baseline, tmp_path):
    run = run_engine_job(tmp_path, _job(demo_model, prompt_ids, backend, CONFIGS[config]()))
    plain = baseline(backend)
    problems = tie_problems(run.token_ids, plain.token_ids, plain.logprobs, TIES[DTYPES[backend]], MIN_EXACT)
    assert not problems, "\n".join(problems)
    assert run.tree_stats["trees_verified"] > 0, run.tree_stats
    assert run.tau > 1.2, run.tree_stats


def test_sampling_distribution_unchanged_on_gpu(demo_model, demo_tokenizer, tmp_path):
    """Temperature 1, retrieval trees of 32 nodes: the 2nd and 3rd tokens keep
    their law (two-sample chi-square over 300 seeds each, alpha = 1e-3)."""
    prompt = next(p for p in load_prompts() if p.repeats_input and p.category == "chat")
    job = {"model": demo_model, "prompt_token_ids": [chat_token_ids(demo_tokenizer, prompt.messages)] * 300,
           "seeds": list(range(300)), "temperature": 1.0, "max_tokens": 3, "max_num_seqs": 64,
           "dtype": "float32", "attention_backend": "TRITON_ATTN"}
    plain = run_engine_job(tmp_path / "plain", job, env=V1_RUNNER)
    spec, _ = SAMPLED_TREES["retrieval-32"]
    run = run_engine_job(tmp_path / "tree", {**job, "seeds": list(range(1000, 1300)), "speculative_config": spec})
    assert run.metrics["vllm:spec_decode_num_accepted_tokens"] > 30, "the trees were rarely accepted"
    for position in (1, 2):
        pvalue = _homogeneity_pvalue([t[position] for t in plain.token_ids], [t[position] for t in run.token_ids])
        assert pvalue > 1e-3, f"token {position}: p = {pvalue:.2g}"
