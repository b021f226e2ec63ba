"""Target features for draft training, computed with transformers.

For every answered prompt: its id, the token ids (prompt + answer), the target's
hidden states after the EAGLE-3 auxiliary layers (vLLM's capture point:
the residual stream entering layer ``k``, i.e. transformers'
``hidden_states[k]``), stored in bf16, and the target's top-``k`` next-token
probabilities at every position (soft labels). Written in shards of
``features-NNN.pt``; shards on disk are kept (the step resumes).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tqdm import tqdm

SHARD_SIZE = 256
TOP_K = 8


def load_target(model_dir: str):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    return model


def compute_features(model_dir: str, answers: Path, work_dir: Path, aux_layer_ids: tuple[int, ...],
                     batch_size: int = 8) -> list[Path]:
    records = [json.loads(line) for line in answers.read_text(encoding="utf-8").splitlines() if line.strip()]
    model = None
    shards = []
    for shard_index, start in enumerate(range(0, len(records), SHARD_SIZE)):
        path = work_dir / f"features-{shard_index:03d}.pt"
        shards.append(path)
        if path.is_file():
            continue
        model = model or load_target(model_dir)
        chunk = records[start:start + SHARD_SIZE]
        shard = {"id": [], "tokens": [], "prompt_len": [], "aux": [], "topk_ids": [], "topk_p": []}
        order = sorted(range(len(chunk)), key=lambda i: len(chunk[i]["prompt_token_ids"]) + len(chunk[i]["answer_token_ids"]))
        batches = [order[i:i + batch_size] for i in range(0, len(order), batch_size)]
        for batch in tqdm(batches, desc=f"features shard {shard_index}", unit="batch"):
            seqs = [chunk[i]["prompt_token_ids"] + chunk[i]["answer_token_ids"] for i in batch]
            for i, seq, out in zip(batch, seqs, _forward(model, seqs, aux_layer_ids)):
                shard["id"].append(chunk[i]["id"])
                shard["tokens"].append(torch.tensor(seq, dtype=torch.int32))
                shard["prompt_len"].append(len(chunk[i]["prompt_token_ids"]))
                for key, value in out.items():
                    shard[key].append(value)
        tmp = path.with_suffix(".tmp")
        torch.save(shard, tmp)
        tmp.rename(path)
    return shards


@torch.no_grad()
def _forward(model, seqs: list[list[int]], aux_layer_ids: tuple[int, ...]):
    length = max(len(s) for s in seqs)
    ids = torch.zeros(len(seqs), length, dtype=torch.long)
    mask = torch.zeros(len(seqs), length, dtype=torch.long)
    for b, seq in enumerate(seqs):
        ids[b, :len(seq)] = torch.tensor(seq)
        mask[b, :len(seq)] = 1
    out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
    aux = torch.cat([out.hidden_states[k] for k in aux_layer_ids], dim=-1)
    probs = out.logits.float().softmax(-1)
    top_p, top_ids = probs.topk(TOP_K, dim=-1)
    for b, seq in enumerate(seqs):
        n = len(seq)
        yield {
            "aux": aux[b, :n].to(torch.bfloat16),
            "topk_ids": top_ids[b, :n].to(torch.int32),
            "topk_p": top_p[b, :n].to(torch.float16),
        }


def load_features(work_dir: Path) -> list[dict]:
    """Every sequence of every shard, as one dict each."""
    sequences = []
    for path in sorted(work_dir.glob("features-*.pt")):
        shard = torch.load(path)
        for i in range(len(shard["tokens"])):
            sequences.append({key: shard[key][i] for key in shard})
    return sequences
