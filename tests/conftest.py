"""Shared fixtures: the demo model and a runner for real engine jobs."""

from __future__ import annotations

import json
import os
import shutil

# Triton kernels run under the interpreter on machines without an NVIDIA GPU;
# it must be set before triton is first imported.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The project's committed EAGLE-3 head for the demo model.
HEAD = str(TESTS.parent / "heads" / "smollm2-135m-eagle3")


@pytest.fixture(scope="session")
def demo_model() -> str:
    from vllm_adaptive_spec.demo_model import ensure_demo_model

    return str(ensure_demo_model())


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


@dataclass
class EngineRun:
    token_ids: list[list[int] | None]
    texts: list[str | None]
    finish_reasons: list[str | None]
    logprobs: list[list[dict[str, float]] | None]  # per request and position: token id -> logprob
    metrics: dict
    tree_stats: dict | None  # tensor-parallel rank 0's
    tree_stats_per_rank: list[dict] | None
    num_gpu_blocks: int | None
    roots: list | None
    stash_drops: int | None
    split_passes: int | None
    probes: int | None
    probe_trees: int | None
    paused_passes: int | None
    draft_free_verifies: int | None
    log: str

    @property
    def tau(self) -> float:
        """Tokens committed per step for steps that verified drafts (vLLM's counters)."""
        drafts = self.metrics.get("vllm:spec_decode_num_drafts", 0)
        return 1.0 + self.metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / max(drafts, 1)


def run_engine_job(tmp_path: Path, job: dict, env: dict[str, str] | None = None) -> EngineRun:
    """Run tests/engine_job.py in a fresh process; fail with its log on error."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    job_file, out_file = tmp_path / "job.json", tmp_path / "out.json"
    job_file.write_text(json.dumps(job))
    proc = subprocess.run(
        [sys.executable, str(TESTS / "engine_job.py"), str(job_file), str(out_file)],
        env={**{k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}, **(env or {})},
        capture_output=True,
        text=True,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        pytest.fail(f"engine job failed (exit {proc.returncode}):\n{log[-6000:]}")
    return EngineRun(**json.loads(out_file.read_text()), log=log)


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
