"""The draft LM command: the target's first layers, loadable, written atomically."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch


@pytest.fixture
def cache(tmp_path, monkeypatch, demo_model):
    """A project cache holding (a link to) the converted demo model."""

    from vllm_adaptive_spec.demo_model import CACHE_ENV, MODEL_NAME

    (tmp_path / MODEL_NAME).symlink_to(Path(demo_model))
    monkeypatch.setenv(CACHE_ENV, str(tmp_path))
    return tmp_path


def test_truncated_draft_keeps_the_targets_first_layers(cache, demo_model):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm

    path = ensure_draft_lm(layers=2, minutes=0)
    assert path.parent == cache and ensure_draft_lm(layers=2, minutes=0) == path
    draft = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert draft.config.num_hidden_layers == 2
    target = load_file(str(Path(demo_model) / "model.safetensors"))
    mine = load_file(str(path / "model.safetensors"))
    assert set(mine) == {k for k in target if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    assert all(torch.equal(mine[k], target[k]) for k in mine)
    assert torch.equal(draft.lm_head.weight, draft.model.embed_tokens.weight)  # tied, as the target


def test_distillation_runs_and_logs(cache, monkeypatch):
    """A short run's steps logged; the steps are small here (a full one,
    8 prompts of 256 tokens through the 30-layer target, takes seconds on a CPU)."""
    from vllm_adaptive_spec.training import train_draft_lm
    from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm

    monkeypatch.setattr(train_draft_lm, "BATCH", 2)
    monkeypatch.setattr(train_draft_lm, "MAX_TOKENS", 32)
    path = ensure_draft_lm(layers=1, minutes=0.01)
    records = [json.loads(line) for line in (path / "distill_log.jsonl").read_text().splitlines()]
    assert records and {"step", "mse", "top1_agreement"} <= set(records[0])
    assert not [p for p in cache.iterdir() if p.name.startswith(".")]  # no staging left behind
