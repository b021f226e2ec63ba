"""The demo model conversion: atomic, and faithful (vLLM == transformers, greedy)."""

from __future__ import annotations

import pytest
import torch

from conftest import chat_token_ids, run_engine_job
from vllm_adaptive_spec import demo_model
from vllm_adaptive_spec.prompts import load_prompts, one_per_category

MAX_TOKENS = 40


def test_interrupted_conversion_is_never_used(tmp_path, monkeypatch):
    monkeypatch.setenv(demo_model.CACHE_ENV, str(tmp_path))

    def half_way(gguf, out):
        (out / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(demo_model, "_convert", half_way)
    with pytest.raises(KeyboardInterrupt):
        demo_model.ensure_demo_model()
    assert list(tmp_path.iterdir()) == [], "a partial conversion was left behind"


def test_incomplete_directory_is_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv(demo_model.CACHE_ENV, str(tmp_path))
    stale = tmp_path / demo_model.MODEL_NAME
    stale.mkdir()
    (stale / "config.json").write_text("{}")

    def convert(gguf, out):
        (out / "model.safetensors").write_text("ok")
        (out / demo_model.COMPLETE_MARKER).write_text("{}")

    monkeypatch.setattr(demo_model, "_convert", convert)
    monkeypatch.setattr(demo_model, "find_gguf", lambda: tmp_path / "x.gguf")
    assert demo_model.ensure_demo_model() == stale
    assert sorted(p.name for p in stale.iterdir()) == [demo_model.COMPLETE_MARKER, "model.safetensors"]
    assert [p.name for p in tmp_path.iterdir()] == [demo_model.MODEL_NAME]


def test_cache_dir_override(tmp_path, monkeypatch):
    monkeypatch.setenv(demo_model.CACHE_ENV, str(tmp_path / "c"))
    assert demo_model.model_dir() == tmp_path / "c" / demo_model.MODEL_NAME


def test_converted_files(demo_model):
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(demo_model)
    assert (config.num_hidden_layers, config.hidden_size, config.vocab_size) == (30, 576, 49152)
    assert config.tie_word_embeddings
    assert not hasattr(config, "quantization_config")
    assert AutoTokenizer.from_pretrained(demo_model).chat_template


@pytest.mark.engine
def test_vllm_greedy_equals_transformers(demo_model, demo_tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM

    prompts = one_per_category(load_prompts())[:3]
    inputs = [chat_token_ids(demo_tokenizer, p.messages) for p in prompts]

    model = AutoModelForCausalLM.from_pretrained(demo_model, dtype=torch.float32).eval()
    expected = []
    with torch.no_grad():
        for ids in inputs:
            out = model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            expected.append(out[0, len(ids):].tolist())

    run = run_engine_job(
        tmp_path,
        {"model": demo_model, "dtype": "float32", "prompt_token_ids": inputs, "max_tokens": MAX_TOKENS},
    )
    for prompt, want, got in zip(prompts, expected, run.token_ids):
        assert got == want, f"{prompt.id}: vLLM {got} != transformers {want}"
