"""Lossless sampling through the adapter's row processing (vLLM's own
temperature / top-k / top-p code) and tree acceptance, on synthetic logits.

Statistical test: chi-square goodness of fit of the committed first two tokens
against the exact processed target law, false-alarm rate alpha = 1e-3.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_adaptive_spec.tree import DraftTree, TreeBatch
from vllm_adaptive_spec.verify import accept

ALPHA = 1e-3
VOCAB = 8
# Root children 0, 1, 2; node 0 (token 0) has children 3 (token 4), 4 (token 5).
TREE = DraftTree(tokens=[0, 1, 2, 4, 5], parents=[-1, -1, -1, 0, 0], q=[0.5, 0.3, 0.2, 0.6, 0.4])


def processed_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent reference of vLLM's order: temperature; keep the top-k
    tokens; renormalise; keep the most likely tokens until their mass reaches
    top_p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k]
    mass = sum(float(probs[t]) for t in kept)
    chosen, running = [], 0.0
    for token in kept:
        if running >= top_p:
            break
        chosen.append(token)
        running += float(probs[token]) / mass
    law = torch.zeros_like(probs)
    law[chosen] = probs[chosen]
    return (law / law.sum()).numpy()


def sampling_metadata(batch: int, temperature: float, top_k: int, top_p: float):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((batch,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((batch,), top_p),
        top_k=torch.full((batch,), top_k, dtype=torch.int32),
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def committed_pairs(row_logits: torch.Tensor, trials: int, temperature: float, top_k: int, top_p: float):
    """Run the adapter's row sampling and acceptance on ``trials`` identical
    requests; return the first committed token and the second (or -1 when the
    first left the tree, where the second would come from a later step)."""
    from vllm_adaptive_spec.adapter.verifier import row_target_tokens

    rows = row_logits.shape[0]
    logits = row_logits.repeat(trials, 1)
    request_of_row = torch.arange(trials).repeat_interleave(rows)
    tokens = row_target_tokens(logits, request_of_row, sampling_metadata(trials, temperature, top_k, top_p))
    result = accept(TreeBatch.from_trees([TREE] * trials), tokens.view(trials, rows))
    first = result.output_tokens[:, 0]
    second = torch.where(result.num_accepted >= 1, result.output_tokens[:, 1], -1)
    return first.numpy(), second.numpy()


def expected_pairs(laws: list[np.ndarray]) -> dict[tuple[int, int], float]:
    """Exact law of (first, second) with the second hidden (-1) off the tree."""
    root = laws[0]
    child_row = {token: node + 1 for node, (token, parent) in enumerate(zip(TREE.tokens, TREE.parents)) if parent == -1}
    cells = {}
    for x1 in range(VOCAB):
        if x1 in child_row:
            for x2 in range(VOCAB):
                cells[(x1, x2)] = root[x1] * laws[child_row[x1]][x2]
        else:
            cells[(x1, -1)] = root[x1]
    return cells


def chi_square_pvalue(first, second, cells) -> float:
    counts = {key: 0 for key in cells}
    for pair in zip(first.tolist(), second.tolist()):
        assert pair in counts, f"impossible outcome {pair}"
        counts[pair] += 1
    n = len(first)
    observed, expected, rare_obs, rare_exp = [], [], 0, 0.0
    for key, prob in cells.items():
        if prob * n < 5:
            rare_obs, rare_exp = rare_obs + counts[key], rare_exp + prob * n
        else:
            observed.append(counts[key])
            expected.append(prob * n)
    if rare_exp > 0:
        observed.append(rare_obs)
        expected.append(rare_exp)
    expected = np.array(expected) * (n / sum(expected))
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, VOCAB, 1.0), (0.7, VOCAB, 1.0), (1.3, 4, 1.0), (1.0, VOCAB, 0.8), (0.8, 5, 0.9)],
)
def test_committed_tokens_follow_the_processed_target(temperature, top_k, top_p):
    torch.manual_seed(0)
    row_logits = torch.randn(1 + len(TREE), VOCAB) * 1.5
    # Make tree tokens likely enough that paths are accepted often.
    row_logits[0, :3] += 1.5
    row_logits[1, 4:6] += 1.5
    laws = [processed_law(row, temperature, top_k, top_p) for row in row_logits]
    first, second = committed_pairs(row_logits, 60_000, temperature, top_k, top_p)
    assert (second >= 0).mean() > 0.3, "the tree was rarely used"
    assert chi_square_pvalue(first, second, expected_pairs(laws)) > ALPHA


def test_the_test_detects_a_wrong_temperature():
    """Power check: samples processed at another temperature are rejected."""
    torch.manual_seed(0)
    row_logits = torch.randn(1 + len(TREE), VOCAB) * 1.5
    laws = [processed_law(row, 1.0, VOCAB, 1.0) for row in row_logits]
    first, second = committed_pairs(row_logits, 60_000, 0.8, VOCAB, 1.0)
    assert chi_square_pvalue(first, second, expected_pairs(laws)) < ALPHA
