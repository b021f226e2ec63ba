"""The target's own answers to the training corpus, generated with vLLM.

Greedy decoding (the answers are then the target's argmax path, which is what
a temperature-0 draft must predict). Written as ``answers.jsonl`` in the work
directory, one object per prompt with the exact token ids vLLM used (chat
template and any earlier turns included), so later stages never re-tokenize. A stage already on
disk is not generated again.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from vllm_adaptive_spec.training.corpus import first_stage, second_stage

ANSWERS = "answers.jsonl"
MAX_MODEL_LEN, MAX_SEQS = 2048, 128


def generate_answers(model: str, work_dir: Path, first: int, second: int, max_tokens: int,
                     corpus_seed: int = 0) -> Path:
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / ANSWERS
    done = _read(path)
    llm = None
    try:
        for stage in (1, 2):
            if any(record["id"].startswith(f"s{stage}-") for record in done):
                continue
            prompts = (first_stage(first, corpus_seed) if stage == 1
                       else second_stage(done, second, corpus_seed + 1))
            if llm is None:
                llm = answer_engine(model)
            records = answer(llm, prompts, max_tokens)
            with path.open("a", encoding="utf-8") as handle:
                for record in records:
                    handle.write(json.dumps(record) + "\n")
            done += records
    finally:
        if llm is not None:
            close_engine(llm)
    return path


def answer_engine(model: str):
    """An offline engine on every core this process may use (vLLM's CPU
    worker otherwise computes on one and keeps the rest for serving: a
    2-core machine generated at about half the rate), with as many of
    ``MAX_SEQS`` requests at a time as the machine's memory holds."""
    from vllm import LLM

    from vllm_adaptive_spec.kv_cache_size import engine_kwargs, fitting_seqs

    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, sorted(os.sched_getaffinity(0)))))
    seqs = fitting_seqs(model, MAX_MODEL_LEN, MAX_SEQS, "float32")
    return LLM(**engine_kwargs(model, "float32", max_model_len=MAX_MODEL_LEN, max_num_seqs=seqs))


def close_engine(llm) -> None:
    """Stop an offline engine's processes now. Left to the garbage collector,
    its worker outlives the answers: in ``train-eagle3`` it would stay up
    through the features with its KV cache resident (up to 13 GiB), and a
    run stopped there would leave it running without a parent."""
    llm.llm_engine.engine_core.shutdown()


def answer(llm, prompts: list[dict], max_tokens: int) -> list[dict]:
    """The target's greedy answers to ``prompts`` (``prompt`` is the last user
    turn, ``history`` any earlier turns), with the token ids vLLM used."""
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    conversations = [[*p.get("history", []), {"role": "user", "content": p["prompt"]}] for p in prompts]
    outputs = llm.chat(conversations, params, use_tqdm=True)
    return [
        {
            **p,
            "answer": out.outputs[0].text,
            "prompt_token_ids": list(out.prompt_token_ids),
            "answer_token_ids": list(out.outputs[0].token_ids),
        }
        for p, out in zip(prompts, outputs)
    ]


def _read(path: Path) -> list[dict]:
    if not path.is_file():
        return []
    with path.open(encoding="utf-8") as handle:
        return [json.loads(line) for line in handle if line.strip()]
