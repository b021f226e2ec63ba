"""Train an EAGLE-3 head for a target on the CPU, resumably.

Pipeline (each stage skipped when its output is on disk): the target's
greedy answers to the project's corpus (vLLM), the target's features
(transformers), then training with training-time test. Loss (EAGLE-3
section 3.3): cross-entropy of each unrolled step against the target's
top-k next-token probabilities, restricted to the draft vocabulary, on
answer positions, step ``j`` weighted ``0.8 ** j``.

Decisions: the draft vocabulary is the most frequent answer tokens; the head
starts from the target (``lm_head`` from the tied embedding rows, the
decoder layer from the target's last layer, ``fc`` picking the highest
auxiliary state), which makes a short CPU run converge.

Reproduce the committed head with::

    vllm-adaptive-spec train-eagle3 --work-dir WORK --out heads/smollm2-135m-eagle3
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from collections import Counter
from pathlib import Path

import torch
from tqdm import tqdm

from vllm_adaptive_spec.training.eagle3_head import Eagle3Head, HeadConfig
from vllm_adaptive_spec.training.features import compute_features, load_features
from vllm_adaptive_spec.training.precision import cpu_autocast

CHECKPOINT = "head-checkpoint.pt"
LOG = "train_log.jsonl"
STEP_WEIGHT = 0.8


def build_draft_vocab(sequences: list[dict], size: int, vocab_size: int) -> torch.Tensor:
    """The ``size`` target tokens most often predicted on answer positions (ascending id)."""
    counts: Counter[int] = Counter()
    for seq in sequences:
        counts.update(seq["topk_ids"][seq["prompt_len"] - 1:, 0].tolist())
    chosen = [token for token, _ in counts.most_common(size)]
    rest = (t for t in range(vocab_size) if t not in set(chosen))
    chosen += [next(rest) for _ in range(size - len(chosen))]
    return torch.tensor(sorted(chosen))


def first_answer_tokens(sequences: list[dict], limit: int) -> list[dict]:
    """The leading ``sequences`` whose answer tokens add up to at most
    ``limit`` (all of them for 0): nested training sets of one corpus, for a
    curve of agreement against training data."""
    if limit <= 0:
        return sequences
    total = 0
    for count, seq in enumerate(sequences):
        total += len(seq["tokens"]) - seq["prompt_len"]
        if total > limit:
            return sequences[:count]
    return sequences


def init_from_target(head: Eagle3Head, target, draft_ids: torch.Tensor) -> None:
    last = target.model.layers[-1]
    h = head.config.hidden_size
    with torch.no_grad():
        head.draft_to_target.copy_(draft_ids)
        head.lm_head.weight.copy_(target.lm_head.weight[draft_ids])
        head.norm.copy_(target.model.norm.weight)
        head.post_attention_layernorm.copy_(last.post_attention_layernorm.weight)
        head.hidden_norm.copy_(last.input_layernorm.weight)
        for mine, theirs in ((head.q_proj, last.self_attn.q_proj), (head.k_proj, last.self_attn.k_proj),
                             (head.v_proj, last.self_attn.v_proj)):
            mine.weight[:, :h].normal_(std=0.02)
            mine.weight[:, h:].copy_(theirs.weight)
        head.o_proj.weight.copy_(last.self_attn.o_proj.weight)
        head.gate_proj.weight.copy_(last.mlp.gate_proj.weight)
        head.up_proj.weight.copy_(last.mlp.up_proj.weight)
        head.down_proj.weight.copy_(last.mlp.down_proj.weight)
        head.fc.weight.zero_()
        head.fc.weight[:, -h:].copy_(torch.eye(h))


def batches(sequences: list[dict], token_budget: int, seed: int) -> list[list[int]]:
    """Index batches of similar lengths, at most ``token_budget`` padded tokens each, shuffled."""
    order = sorted(range(len(sequences)), key=lambda i: len(sequences[i]["tokens"]))
    groups, current = [], []
    for i in order:
        length = len(sequences[i]["tokens"])
        if current and length * (len(current) + 1) > token_budget:
            groups.append(current)
            current = []
        current.append(i)
    if current:
        groups.append(current)
    random.Random(seed).shuffle(groups)
    return groups


def collate(sequences: list[dict], indices: list[int]):
    items = [sequences[i] for i in indices]
    length = max(len(s["tokens"]) for s in items)
    batch = len(items)
    k = items[0]["topk_ids"].shape[1]
    tokens = torch.zeros(batch, length, dtype=torch.long)
    aux = torch.zeros(batch, length, items[0]["aux"].shape[1], dtype=torch.bfloat16)
    top_ids = torch.zeros(batch, length, k, dtype=torch.long)
    top_p = torch.zeros(batch, length, k)
    answer = torch.zeros(batch, length, dtype=torch.bool)
    for b, s in enumerate(items):
        n = len(s["tokens"])
        tokens[b, :n] = s["tokens"].long()
        aux[b, :n] = s["aux"]
        top_ids[b, :n] = s["topk_ids"].long()
        top_p[b, :n] = s["topk_p"].float()
        answer[b, s["prompt_len"] - 1:n - 1] = True  # positions whose next token is an answer token
    return tokens, aux, top_ids, top_p, answer


def step_losses(head: Eagle3Head, tokens, aux, top_ids, top_p, answer, steps: int, target_to_draft: torch.Tensor):
    """Per-step (loss, correct, count): row ``p`` of step ``j`` is scored
    against the target's distribution at position ``p + j + 1``."""
    with cpu_autocast():
        all_logits = head.training_forward(tokens, aux.float(), steps)
    results = []
    length = tokens.shape[1]
    for j, logits in enumerate(all_logits):
        shift = j + 1
        rows = logits[:, :length - shift].float().log_softmax(-1)
        ids, p, mask = top_ids[:, shift:], top_p[:, shift:], answer[:, shift:]
        draft = target_to_draft[ids]
        in_vocab = draft >= 0
        picked = rows.gather(-1, draft.clamp(min=0))
        loss = -(picked * p * in_vocab).sum(-1)
        count = mask.sum()
        predicted = head.draft_to_target[rows.argmax(-1)]
        correct = ((predicted == ids[..., 0]) & mask).sum()
        results.append(((loss * mask).sum() / count.clamp(min=1), int(correct), int(count)))
    return results


def train(args) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.work_dir)
    from vllm_adaptive_spec.training.answers import generate_answers

    answers = generate_answers(args.model, work, args.first_stage, args.second_stage, args.max_answer_tokens,
                               args.corpus_seed)
    from transformers import AutoConfig

    target_config = AutoConfig.from_pretrained(args.model)
    probe = HeadConfig.for_target(target_config, args.draft_vocab)
    compute_features(args.model, answers, work, probe.aux_layer_ids)
    sequences = load_features(work)
    random.Random(args.seed).shuffle(sequences)
    held = max(1, int(len(sequences) * args.holdout))
    heldout, trainset = sequences[:held], sequences[held:]
    trainset = first_answer_tokens(trainset, args.train_tokens)

    from vllm_adaptive_spec.training.features import load_target

    target = load_target(args.model)
    head = Eagle3Head(probe, target.model.embed_tokens.weight)
    checkpoint_path = work / CHECKPOINT
    per_epoch = len(batches(trainset, args.token_budget, 0))
    total_steps = per_epoch * args.epochs
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0, betas=(0.9, 0.95))
    start = 0
    if checkpoint_path.is_file():
        state = torch.load(checkpoint_path)
        head.draft_to_target.copy_(state["draft_to_target"])
        head.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        start = state["step"]
        print(f"resumed at step {start}/{total_steps}")
    elif args.init_from:
        head.load_state_dict(Eagle3Head.load(Path(args.init_from), target.model.embed_tokens.weight).state_dict())
    else:
        init_from_target(head, target, build_draft_vocab(trainset, args.draft_vocab, probe.vocab_size))
    del target
    target_to_draft = head.target_to_draft()

    def lr_at(step: int) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        progress = (step - args.warmup) / max(1, total_steps - args.warmup)
        return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))

    log = (work / LOG).open("a", encoding="utf-8")
    bar = tqdm(total=total_steps, initial=start, desc="train eagle3", unit="step")
    step = start
    while step < total_steps:
        epoch, offset = divmod(step, per_epoch)
        plan = batches(trainset, args.token_budget, args.seed + epoch)
        for indices in plan[offset:]:
            began = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = lr_at(step)
            tokens, aux, top_ids, top_p, answer = collate(trainset, indices)
            results = step_losses(head, tokens, aux, top_ids, top_p, answer, args.ttt_steps, target_to_draft)
            loss = sum(STEP_WEIGHT ** j * r[0] for j, r in enumerate(results))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            optimizer.step()
            step += 1
            record = {"step": step, "epoch": epoch, "loss": round(float(loss), 4), "lr": lr_at(step - 1),
                      "acc": [round(c / max(n, 1), 4) for _, c, n in results],
                      "tokens_per_s": round(int(tokens.numel()) / (time.perf_counter() - began), 1)}
            if step % args.eval_every == 0 or step == total_steps:
                record["heldout_acc"] = evaluate(head, heldout, args, target_to_draft)
                _save(checkpoint_path, head, optimizer, step)
                head.save(Path(args.out))
            log.write(json.dumps(record) + "\n")
            log.flush()
            bar.update(1)
            bar.set_postfix(loss=record["loss"], acc0=record["acc"][0])
            if step >= total_steps:
                break
    bar.close()
    _save(checkpoint_path, head, optimizer, step)
    head.save(Path(args.out))
    print(f"head written to {args.out}")


@torch.no_grad()
def evaluate(head: Eagle3Head, heldout: list[dict], args, target_to_draft) -> list[float]:
    """Top-1 agreement with the target's argmax, per unrolled step, on held-out answers."""
    correct, count = agreement(head, heldout, args.ttt_steps, args.token_budget, target_to_draft)
    return [round(c / max(n, 1), 4) for c, n in zip(correct, count)]


@torch.no_grad()
def agreement(head: Eagle3Head, sequences: list[dict], steps: int, token_budget: int,
              target_to_draft) -> tuple[list[int], list[int]]:
    """Per unrolled step: answer positions where the head's argmax is the target's, and all of them."""
    correct, count = [0] * steps, [0] * steps
    for indices in batches(sequences, token_budget, 0):
        for j, (_, c, n) in enumerate(step_losses(head, *collate(sequences, indices), steps, target_to_draft)):
            correct[j] += c
            count[j] += n
    return correct, count


def _save(path: Path, head: Eagle3Head, optimizer, step: int) -> None:
    tmp = path.with_suffix(".tmp")
    torch.save({"model": head.state_dict(), "draft_to_target": head.draft_to_target,
                "optimizer": optimizer.state_dict(), "step": step}, tmp)
    tmp.rename(path)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-adaptive-spec train-eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="target model directory (default: the demo model)")
    p.add_argument("--work-dir", required=True, help="answers, features, checkpoint and log live here")
    p.add_argument("--out", required=True, help="directory for the exported head")
    p.add_argument("--first-stage", type=int, default=1500, help="prompts of the first corpus stage")
    p.add_argument("--second-stage", type=int, default=500, help="prompts of the second stage (over the first stage's answers)")
    p.add_argument("--corpus-seed", type=int, default=0,
                   help="seed of the corpus's sampling (stage 2 uses it plus one); another seed, other prompts")
    p.add_argument("--max-answer-tokens", type=int, default=160)
    p.add_argument("--draft-vocab", type=int, default=8192)
    p.add_argument("--init-from", default=None,
                   help="start from this head (its weights and draft vocabulary) instead of the target's last layer")
    p.add_argument("--ttt-steps", type=int, default=4, help="unrolled steps of training-time test")
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--token-budget", type=int, default=4096, help="padded tokens per batch")
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--holdout", type=float, default=0.03)
    p.add_argument("--train-tokens", type=int, default=0,
                   help="train on the leading sequences (after the seeded shuffle) of at most this many answer tokens; "
                        "0: all. The held-out split does not change")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.model is None:
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    train(args)
