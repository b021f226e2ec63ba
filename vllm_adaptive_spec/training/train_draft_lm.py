"""A draft LM for the demo model: its first layers, briefly distilled.

The draft keeps the target's embedding (tied with its LM head), its first
``layers`` decoder layers and its final norm; then, for ``minutes`` of CPU
time, those layers and the norm are trained to match the target's final
(normed) hidden states, which the shared LM head turns into next-token logits
(mean squared error, see :func:`_distill`), on the training corpus's prompts
(``corpus.first_stage``, chat template applied; teacher forcing, so no
generation is needed and the command stands alone).
``minutes=0`` gives the plain truncated model (what the tests use: exactness
does not depend on the draft). Written like the demo model: to a temporary
directory, then renamed, with a completion marker.

Reproduce the benchmark's draft LM with ``vllm-adaptive-spec draft-lm``.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_adaptive_spec.demo_model import COMPLETE_MARKER, cache_root, ensure_demo_model, publish
from vllm_adaptive_spec.training.precision import cpu_autocast


def draft_lm_dir(layers: int, minutes: float) -> Path:
    tag = f"L{layers}" + (f"-distilled{minutes:g}m" if minutes > 0 else "")
    return cache_root() / f"SmolLM2-135M-Instruct-draft-{tag}"


def ensure_draft_lm(layers: int = 4, minutes: float = 0.0, seed: int = 0) -> Path:
    target = draft_lm_dir(layers, minutes)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build(ensure_demo_model(), staging, layers, minutes, seed)
        publish(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


BATCH, MAX_TOKENS = 8, 256  # a distillation step's prompts, and the most tokens of each


def _prompts() -> list[str]:
    """The distillation's prompts (the EAGLE-3 corpus's first stage)."""
    from vllm_adaptive_spec.training.corpus import first_stage

    return [p["prompt"] for p in first_stage(10_000)]


def _encoded(tokenizer, prompt: str) -> list[int]:
    """A prompt as the chat template frames it, at most ``MAX_TOKENS``; encoded
    when a step samples it (encoding the whole corpus up front took longer
    than a short run's training)."""
    return tokenizer.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                         tokenize=True)["input_ids"][:MAX_TOKENS]


def _build(source: Path, out: Path, layers: int, minutes: float, seed: int) -> None:
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    teacher = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    if not 1 <= layers < teacher.config.num_hidden_layers:
        raise ValueError(f"layers must be from 1 to {teacher.config.num_hidden_layers - 1}, got {layers}")
    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    config.num_hidden_layers = layers
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in teacher.state_dict().items() if not k.startswith("model.layers.")}
    state.update({k: v for k, v in teacher.state_dict().items()
                  if k.startswith("model.layers.") and int(k.split(".")[2]) < layers})
    student.load_state_dict(state, strict=False)
    student.tie_weights()
    tokenizer = AutoTokenizer.from_pretrained(source)

    if minutes > 0:
        _distill(teacher, student, tokenizer, _prompts(), minutes, seed, out)

    config.torch_dtype = torch.bfloat16
    config.save_pretrained(out)
    teacher.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in student.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / COMPLETE_MARKER).write_text(json.dumps({"source": str(source.name), "layers": layers, "minutes": minutes}) + "\n")


def _distill(teacher, student, tokenizer, prompts: list[str], minutes: float, seed: int, out: Path) -> None:
    """Match the target's final (normed) hidden states, which the shared LM head
    turns into logits: mean squared error, cheaper than a KL over 49k tokens."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    student.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=5e-4, weight_decay=0.0)
    head = teacher.lm_head.weight
    deadline = time.monotonic() + minutes * 60
    log = (out / "distill_log.jsonl").open("w", encoding="utf-8")
    bar = tqdm(desc="distill draft LM", unit="step")
    step = 0
    student.train()
    while time.monotonic() < deadline:
        batch = [_encoded(tokenizer, prompt) for prompt in rng.sample(prompts, BATCH)]
        length = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        mask = torch.zeros(len(batch), length, dtype=torch.bool)
        for b, s in enumerate(batch):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = True
        with torch.no_grad():
            target = teacher.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state[mask]
        with cpu_autocast():
            hidden = student.model(input_ids=ids, attention_mask=mask.long()).last_hidden_state
        hidden = hidden[mask].float()
        loss = (hidden - target).pow(2).mean()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        with torch.no_grad():
            rows = torch.randperm(target.shape[0])[:128]
            agree = float(((hidden[rows] @ head.T).argmax(-1) == (target[rows] @ head.T).argmax(-1)).float().mean())
        mse = loss.item()
        log.write(json.dumps({"step": step, "mse": round(mse, 4), "top1_agreement": round(agree, 4)}) + "\n")
        bar.update(1)
        bar.set_postfix(mse=round(mse, 3), top1=round(agree, 3))
    bar.close()
    log.close()
    student.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-adaptive-spec draft-lm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept from the target")
    parser.add_argument("--minutes", type=float, default=6.0, help="distillation time (0: truncation only)")
    args = parser.parse_args(argv)
    print(ensure_draft_lm(args.layers, args.minutes))
