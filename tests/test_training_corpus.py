"""The head's training corpus (varied, reproducible, disjoint from the benchmark
prompts) and the per-category agreement score of ``eval-eagle3`` (plain logic,
no engine)."""

import json
from collections import Counter

import torch

from test_eagle3_head import small_head
from vllm_adaptive_spec.prompts import DEFAULT_PROMPTS
from vllm_adaptive_spec.training.corpus import first_stage, second_stage
from vllm_adaptive_spec.training.evaluate_head import per_category


def test_first_stage_is_varied_reproducible_and_not_the_benchmark():
    prompts = first_stage(1500)
    assert prompts == first_stage(1500)
    assert len(prompts) == 1500 and len({p["id"] for p in prompts}) == 1500
    counts = Counter(p["category"] for p in prompts)
    assert set(counts) == {"qa", "chat", "code", "math", "translation", "summarization", "rag"}
    assert min(counts.values()) >= 50, counts
    texts = [p["prompt"] for p in prompts]
    assert len(set(texts)) >= 0.97 * len(texts)
    assert sum("```python" in t for t in texts) >= 100  # code from the standard library's source
    benchmark = set()
    for line in DEFAULT_PROMPTS.read_text(encoding="utf-8").splitlines():
        benchmark |= {m["content"] for m in json.loads(line)["messages"] if m["role"] == "user"}
    assert not benchmark & set(texts)


def test_second_stage_builds_on_the_answers():
    answered = [
        {"id": f"s1-{i:05d}", "category": category, "prompt": f"question {i}", "answer": f"answer {i} " + "x" * 300}
        for i, category in enumerate(("qa", "code", "math", "translation", "chat", "qa") * 10)
    ]
    prompts = second_stage(answered, 60)
    assert len(prompts) == 60 and all(p["id"].startswith("s2-") for p in prompts)
    kinds = Counter(p["category"] for p in prompts)
    assert kinds["chat"] and kinds["summarization"] and kinds["rag"] and kinds["translation"]
    for p in prompts:
        if "history" in p:
            user, assistant = p["history"]
            source = next(a for a in answered if a["prompt"] == user["content"])
            assert assistant == {"role": "assistant", "content": source["answer"]}
        else:
            assert any(a["answer"][:200] in p["prompt"] for a in answered)


def test_agreement_is_scored_per_category():
    head = small_head()
    head.eval()
    length = 10

    def sequence(seq_id: str, agree: bool) -> dict:
        tokens = torch.randint(0, 60, (length,))
        aux = torch.randn(length, 3 * head.config.hidden_size).bfloat16()  # stored in bf16, scored in float32
        with torch.no_grad():
            logits = head.training_forward(tokens[None], aux[None].float(), 1)[0][0]
        predicted = head.draft_to_target[logits.argmax(-1)]
        # the label of position p + 1 is what step 0 predicts at row p
        first = torch.roll(predicted, 1)
        if not agree:
            first = (first + 1) % 60
        topk = torch.stack([first, (first + 2) % 60], dim=-1)
        return {"id": seq_id, "tokens": tokens.int(), "aux": aux, "prompt_len": 3,
                "topk_ids": topk.int(), "topk_p": torch.tensor([0.6, 0.4]).expand(length, 2).half()}

    torch.manual_seed(0)
    sequences = [sequence("a1", True), sequence("b1", False), sequence("a2", True)]
    result = per_category(head, sequences, {"a1": "good", "a2": "good", "b1": "bad"}, steps=1, token_budget=64)
    assert result["good"] == [1.0]
    assert result["bad"] == [0.0]
    assert abs(result["all"][0] - 2 / 3) < 1e-3
