"""The project's prompt set (``vllm_adaptive_spec/data/prompts.jsonl``,
shipped as package data so an installed package's demo has it).

One JSON object per line: ``id``, ``category``, ``messages`` (OpenAI chat
format, ending with a user turn) and ``repeats_input`` (a good answer copies
long spans of the prompt).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PROMPTS = Path(__file__).resolve().parent / "data" / "prompts.jsonl"


@dataclass(frozen=True)
class Prompt:
    id: str
    category: str
    messages: list[dict[str, str]]
    repeats_input: bool


def load_prompts(path: str | Path | None = None) -> list[Prompt]:
    path = Path(path) if path is not None else DEFAULT_PROMPTS
    if not path.is_file():
        raise FileNotFoundError(f"prompt set {path} not found; pass the path of a prompts.jsonl")
    with path.open(encoding="utf-8") as handle:
        return [Prompt(**json.loads(line)) for line in handle if line.strip()]


def one_per_category(prompts: list[Prompt]) -> list[Prompt]:
    """The first prompt of each category, in the order categories appear."""
    seen: dict[str, Prompt] = {}
    for prompt in prompts:
        seen.setdefault(prompt.category, prompt)
    return list(seen.values())
