"""A draft LM for the demo model: its first layers, briefly distilled.

The draft keeps the target's embedding (tied with its LM head), its first
``layers`` decoder layers and its final norm; then, for ``minutes`` of CPU
time, those layers and the norm are trained to match the target's next-token
distribution (KL divergence, full vocabulary) on the training corpus's prompts
(``corpus.first_stage``; teacher forcing, so no generation is needed) and on
the target's own answers when a training work directory holds them.
``minutes=0`` gives the plain truncated model (what the tests use: exactness
does not depend on the draft). Written like the demo model: to a temporary
directory, then renamed, with a completion marker.

Reproduce the benchmark's draft LM with ``vllm-adaptive-spec draft-lm``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_adaptive_spec.demo_model import COMPLETE_MARKER, cache_root, ensure_demo_model


def draft_lm_dir(layers: int, minutes: float) -> Path:
    tag = f"L{layers}" + (f"-distilled{minutes:g}m" if minutes > 0 else "")
    return cache_root() / f"SmolLM2-135M-Instruct-draft-{tag}"


def ensure_draft_lm(layers: int = 4, minutes: float = 0.0, work_dir: Path | None = None, seed: int = 0) -> Path:
    target = draft_lm_dir(layers, minutes)
    if (target / COMPLETE_MARKER).is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    try:
        _build(ensure_demo_model(), staging, layers, minutes, work_dir, seed)
        if target.exists():
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _sequences(tokenizer, work_dir: Path | None) -> list[list[int]]:
    from vllm_adaptive_spec.training.answers import ANSWERS
    from vllm_adaptive_spec.training.corpus import first_stage

    seqs = [
        tokenizer.apply_chat_template([{"role": "user", "content": p["prompt"]}], add_generation_prompt=True,
                                      tokenize=True)["input_ids"]
        for p in first_stage(10_000)
    ]
    answers = None if work_dir is None else Path(work_dir) / ANSWERS
    if answers is not None and answers.is_file():
        for line in answers.read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            seqs.append(record["prompt_token_ids"] + record["answer_token_ids"])
    return [list(s) for s in seqs]


def _build(source: Path, out: Path, layers: int, minutes: float, work_dir: Path | None, seed: int) -> None:
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
        _distill(teacher, student, _sequences(tokenizer, work_dir), minutes, seed, out)

    config.torch_dtype = torch.bfloat16
    config.save_pretrained(out)
    teacher.generation_config.save_pretrained(out)
    tokenizer.save_pretrained(out)
    weights = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in student.state_dict().items() if k != "lm_head.weight"}
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / COMPLETE_MARKER).write_text(json.dumps({"source": str(source.name), "layers": layers, "minutes": minutes}) + "\n")


def _distill(teacher, student, sequences: list[list[int]], minutes: float, seed: int, out: Path) -> None:
    torch.manual_seed(seed)
    rng = random.Random(seed)
    student.model.embed_tokens.weight.requires_grad_(False)
    params = [p for p in student.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=3e-4, weight_decay=0.0)
    deadline = time.monotonic() + minutes * 60
    log = (out / "distill_log.jsonl").open("w", encoding="utf-8")
    bar = tqdm(desc="distill draft LM", unit="step", total=None)
    step = 0
    student.train()
    while time.monotonic() < deadline:
        batch = [s[:256] for s in rng.sample(sequences, 8)]
        length = max(len(s) for s in batch)
        ids = torch.zeros(len(batch), length, dtype=torch.long)
        mask = torch.zeros(len(batch), length, dtype=torch.long)
        for b, s in enumerate(batch):
            ids[b, : len(s)] = torch.tensor(s)
            mask[b, : len(s)] = 1
        with torch.no_grad():
            target = teacher(input_ids=ids, attention_mask=mask).logits.float().log_softmax(-1)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = student(input_ids=ids, attention_mask=mask).logits
        log_q = logits.float().log_softmax(-1)
        kl = (target.exp() * (target - log_q)).sum(-1)
        loss = (kl * mask).sum() / mask.sum()
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        step += 1
        agree = ((target.argmax(-1) == log_q.argmax(-1)) & mask.bool()).sum() / mask.sum()
        log.write(json.dumps({"step": step, "kl": round(float(loss), 4), "top1_agreement": round(float(agree), 4)}) + "\n")
        bar.update(1)
        bar.set_postfix(kl=round(float(loss), 3), top1=round(float(agree), 3))
    bar.close()
    log.close()
    student.eval()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-adaptive-spec draft-lm", description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=4, help="decoder layers kept from the target")
    parser.add_argument("--minutes", type=float, default=6.0, help="distillation time (0: truncation only)")
    parser.add_argument("--work-dir", default=None, help="a train-eagle3 work directory whose answers to add")
    args = parser.parse_args(argv)
    print(ensure_draft_lm(args.layers, args.minutes, Path(args.work_dir) if args.work_dir else None))
