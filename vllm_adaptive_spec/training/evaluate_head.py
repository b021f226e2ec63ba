"""How well EAGLE-3 heads agree with the target on prompts they were not trained on.

``vllm-adaptive-spec eval-eagle3 --heads A B --work-dir W``: the target's
greedy answers to the benchmark prompts (vLLM, float32, as for training), its
features (transformers, float32), then for each head the top-1 agreement
with the target's argmax per unrolled step of training-time test, per prompt
category and over all answer positions. This is the figure the head's
goal is set on (0.40 at the first step); the held-out figure of
``train_log.jsonl`` is measured on the training corpus instead.

The answers and features stay in the work directory, so heads compared later
are scored on the same positions.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

ANSWERS = "benchmark_answers.jsonl"


def benchmark_answers(model: str, work_dir: Path, prompts_path: str | None, max_tokens: int) -> Path:
    from vllm_adaptive_spec.prompts import load_prompts
    from vllm_adaptive_spec.training.answers import answer, answer_engine, close_engine

    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / ANSWERS
    if not path.is_file():
        prompts = [{"id": p.id, "category": p.category, "prompt": p.messages[-1]["content"],
                    "history": p.messages[:-1]} for p in load_prompts(prompts_path)]
        llm = answer_engine(model)
        try:
            records = answer(llm, prompts, max_tokens)
        finally:
            close_engine(llm)
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
        tmp.rename(path)
    return path


def per_category(head, sequences: list[dict], categories: dict[str, str], steps: int,
                 token_budget: int) -> dict[str, list[float]]:
    """``{category: [top-1 per step]}``, plus ``"all"`` over every answer position."""
    from vllm_adaptive_spec.training.train_eagle3 import agreement

    target_to_draft = head.target_to_draft()
    groups = defaultdict(list)
    for seq in sequences:
        groups[categories[seq["id"]]].append(seq)
    out, total_c, total_n = {}, [0] * steps, [0] * steps
    for category in sorted(groups):
        correct, count = agreement(head, groups[category], steps, token_budget, target_to_draft)
        out[category] = [round(c / max(n, 1), 4) for c, n in zip(correct, count)]
        total_c = [a + b for a, b in zip(total_c, correct)]
        total_n = [a + b for a, b in zip(total_n, count)]
    out["all"] = [round(c / max(n, 1), 4) for c, n in zip(total_c, total_n)]
    return out


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-adaptive-spec eval-eagle3", description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", nargs="+", required=True, help="EAGLE-3 head directories to score")
    p.add_argument("--work-dir", required=True, help="the benchmark answers and their features live here")
    p.add_argument("--model", default=None, help="target model directory (default: the demo model)")
    p.add_argument("--prompts", default=None, help="prompt set (default: vllm_adaptive_spec/data/prompts.jsonl)")
    p.add_argument("--max-tokens", type=int, default=192)
    p.add_argument("--steps", type=int, default=4, help="unrolled steps to score")
    p.add_argument("--token-budget", type=int, default=4096)
    p.add_argument("--out", default=None, help="also write the figures here as JSON")
    return p


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.model is None:
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    from vllm_adaptive_spec.training.eagle3_head import Eagle3Head
    from vllm_adaptive_spec.training.features import compute_features, load_features, load_target

    work = Path(args.work_dir)
    answers = benchmark_answers(args.model, work, args.prompts, args.max_tokens)
    categories = {}
    for line in answers.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        categories[record["id"]] = record["category"]
    embed = load_target(args.model).model.embed_tokens.weight.detach()
    heads = {directory: Eagle3Head.load(Path(directory), embed) for directory in args.heads}
    aux_ids = {head.config.aux_layer_ids for head in heads.values()}
    if len(aux_ids) != 1:
        raise SystemExit(f"the heads read different target layers ({sorted(aux_ids)}); score them separately")
    compute_features(args.model, answers, work, aux_ids.pop())
    sequences = load_features(work)
    results = {}
    for directory, head in heads.items():
        head.eval()
        results[directory] = per_category(head, sequences, categories, args.steps, args.token_budget)
    for directory, table in results.items():
        print(f"\n{directory}: top-1 agreement with the target per unrolled step")
        for category, values in table.items():
            print(f"  {category:14s} " + " ".join(f"{v:.3f}" for v in values))
    if args.out:
        Path(args.out).write_text(json.dumps({"answers": len(sequences), "results": results}, indent=2) + "\n")
