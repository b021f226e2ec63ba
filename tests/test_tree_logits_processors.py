"""``logit_bias`` and ``min_p`` on tree rows: each row gets what
vLLM's own processors give its request's row without speculation, read
from those processors' state."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinPLogitsProcessor,
    MinTokensLogitsProcessor,
)

from vllm_adaptive_spec.adapter.tree_logits_processors import (
    apply_row_logit_bias,
    apply_row_min_p,
    apply_row_min_tokens,
    has_logit_bias,
    has_min_tokens,
)

VOCAB = 16


def processors(biases: dict[int, dict[int, float]], min_p: list[float]):
    bias = LogitBiasLogitsProcessor.__new__(LogitBiasLogitsProcessor)
    bias.biases = biases
    bias.bias_tensor = torch.tensor([v for lb in biases.values() for v in lb.values()])
    bias.logits_slice = (torch.tensor([r for r, lb in biases.items() for _ in lb]),
                         torch.tensor([t for lb in biases.values() for t in lb]))
    low = MinPLogitsProcessor.__new__(MinPLogitsProcessor)
    low.min_p_count = sum(1 for v in min_p if v)
    low.min_p = torch.tensor(min_p).unsqueeze(1)
    return SimpleNamespace(logitsprocs=SimpleNamespace(non_argmax_invariant=[bias], argmax_invariant=[low])), bias, low


def test_rows_get_their_requests_bias_and_min_p_as_vllm_applies_them():
    biases = {0: {3: -2.0, 7: 1.5}, 2: {1: 4.0}}
    metadata, bias, low = processors(biases, [0.0, 0.3, 0.1])
    owners = [2, 2, 2, 0, 1, 1]  # a request's rows: its root's and its nodes'
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(len(owners), VOCAB, generator=gen)
    rows = logits.clone()
    apply_row_logit_bias(rows, owners, metadata)
    apply_row_min_p(rows, torch.tensor(owners), metadata)
    # vLLM's processors on a batch of the three requests, one row each, for every row's position.
    for row, owner in enumerate(owners):
        batch = logits[row].expand(3, VOCAB).clone()
        batch = low.apply(bias.apply(batch))
        assert torch.equal(rows[row], batch[owner]), row
    assert has_logit_bias(metadata, [1, 2]) and not has_logit_bias(metadata, [1])
    assert (rows == float("-inf")).any() and not torch.equal(rows, logits)


def test_stop_tokens_are_masked_while_the_output_and_path_are_too_short():
    """Request 0 has 3 tokens out of ``min_tokens`` 5: its rows at path length
    0 and 1 cannot stop, from length 2 on they can; request 1 has none."""
    pending = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    pending.min_toks = {0: (5, [4, 4, 4], {2, 9}, False)}
    metadata = SimpleNamespace(logitsprocs=SimpleNamespace(non_argmax_invariant=[pending], argmax_invariant=[]))
    owners, depths = [0, 0, 0, 0, 1], [0, 1, 2, 1, 0]
    logits = torch.zeros(len(owners), VOCAB)
    apply_row_min_tokens(logits, owners, depths, metadata)
    masked = [sorted(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in logits]
    assert masked == [[2, 9], [2, 9], [], [2, 9], []]
    assert has_min_tokens(metadata, [1, 0]) and not has_min_tokens(metadata, [1])


def test_a_structured_rows_stop_token_stays_where_its_grammar_allows_nothing_else():
    """vLLM's restore: a structured request (request 0) whose grammar, after a
    row's path, allows only a stop token keeps that token on that row (masking
    it would leave the row all ``-inf`` and draw token 0); its other rows and
    an unstructured request's row (request 1) are masked as before."""
    pending = MinTokensLogitsProcessor.__new__(MinTokensLogitsProcessor)
    pending.min_toks = {0: (5, [4], {2, 9}, True), 1: (5, [4], {2, 9}, False)}
    metadata = SimpleNamespace(logitsprocs=SimpleNamespace(non_argmax_invariant=[pending], argmax_invariant=[]))
    owners, depths = [0, 0, 1], [0, 1, 0]
    logits = torch.zeros(len(owners), VOCAB)
    logits[1, :] = float("-inf")
    logits[1, 2] = 0.5  # row 1: the grammar ended, only stop token 2 allowed
    logits[2, :] = float("-inf")
    logits[2, 9] = 0.25  # request 1 has no grammar: masked all the same
    apply_row_min_tokens(logits, owners, depths, metadata)
    masked = [sorted(torch.nonzero(row == float("-inf")).flatten().tolist()) for row in logits]
    assert masked[0] == [2, 9]
    assert masked[1] == [t for t in range(VOCAB) if t != 2] and logits[1, 2] == 0.5
    assert masked[2] == list(range(VOCAB))
