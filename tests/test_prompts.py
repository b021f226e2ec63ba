"""The project's prompt set is well formed and covers every category."""

from collections import Counter

from vllm_adaptive_spec.prompts import load_prompts

CATEGORIES = {"chat", "code", "math", "summarization", "qa", "translation", "rag"}


def test_prompt_set():
    prompts = load_prompts()
    assert len(prompts) >= 60
    assert len({p.id for p in prompts}) == len(prompts)
    counts = Counter(p.category for p in prompts)
    assert set(counts) == CATEGORIES and min(counts.values()) >= 8
    for p in prompts:
        assert p.messages[-1]["role"] == "user", p.id
        assert all(m["role"] in {"system", "user", "assistant"} and m["content"] for m in p.messages), p.id
    assert all(len(p.messages) >= 3 for p in prompts if p.category == "chat")
    assert sum(p.repeats_input for p in prompts) >= 15
