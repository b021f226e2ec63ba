"""The fused draft-distribution kernel (interpreted off GPU) against its torch
reference: vocabularies of several tiles, whole and ending in a partial tile,
ties (across a tile boundary too), -inf entries, bf16 and fp32; the reference
against a dense softmax."""

from __future__ import annotations

import pytest
import torch

from kernels.draft_distribution import (
    draft_distribution,
    draft_distribution_reference,
    draft_distribution_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def make_logits(rows: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Logits flat enough that, over a few thousand tokens, the m-th
    probability still moves the entropy beyond its tolerance (an entropy one
    term short fails), and the 16 tokens set to 9.0 are the top ones, so a
    top-k cut falls among ties."""
    gen = torch.Generator().manual_seed(seed)
    logits = 1.5 * torch.randn(rows, vocab, generator=gen)
    logits[0, :: 7] = float("-inf")  # masked tokens
    logits[1, 1000:1040] = logits[1].max() + 1.0  # 40 tied best tokens, across the first tile boundary
    logits[2, torch.randperm(vocab, generator=gen)[:16]] = 9.0  # ties inside the top-k
    return logits.to(dtype)


# The kernel reads a row in tiles of 1,024 (its default): 6,144 is six whole
# tiles, 4,999 ends in a partial one. A real vocabulary (49,152 or 128,256)
# runs the same code over more tiles, which the interpreter pays for tile by
# tile (the m = 1000 case took 13 s at 128,256).
@pytest.mark.parametrize(
    "vocab, dtype, k, m",
    [
        (6144, torch.float32, 16, 0),
        (6144, torch.bfloat16, 10, 64),  # bf16: many more ties
        (4999, torch.float32, 4, 1000),  # C2T's top-1000 entropy
        (4999, torch.bfloat16, 16, 0),
    ],
)
def test_kernel_matches_the_reference(vocab, dtype, k, m):
    logits = make_logits(3, vocab, dtype, seed=vocab + k).to(DEVICE)
    got = draft_distribution_triton(logits, k, m)
    want = draft_distribution_reference(logits, k, m)
    x = logits.float()
    # Ties go to the lower token id: exactly a stable descending sort's order.
    stable = torch.sort(x, dim=-1, descending=True, stable=True).indices[:, :k]
    assert torch.equal(got.tokens, stable)
    torch.testing.assert_close(x.gather(1, got.tokens), x.gather(1, want.tokens), rtol=0, atol=0)
    torch.testing.assert_close(got.probs, want.probs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.confidence, want.confidence, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(got.entropy, want.entropy, rtol=1e-4, atol=1e-5)
    if m == 0:
        assert torch.all(got.entropy == 0)


def test_small_vocabulary_and_few_rows():
    logits = torch.tensor([[0.0, 1.0, 2.0, float("-inf"), 2.0]], device=DEVICE)
    got = draft_distribution_triton(logits, 3, 5)
    assert got.tokens.tolist() == [[2, 4, 1]]
    p = torch.softmax(logits[0], -1)
    torch.testing.assert_close(got.probs[0], p[[2, 4, 1]])
    expected_entropy = -(p[p > 0] * p[p > 0].log()).sum()
    torch.testing.assert_close(got.entropy[0], expected_entropy, rtol=1e-5, atol=1e-6)
    empty = draft_distribution_triton(torch.zeros(0, 5, device=DEVICE), 2)
    assert empty.tokens.shape == (0, 2)


def test_reference_matches_a_dense_softmax():
    logits = make_logits(4, 1000, torch.float32, seed=1)
    got = draft_distribution_reference(logits, 8, 100)
    p = torch.softmax(logits, -1)
    top = p.topk(100, dim=-1).values
    torch.testing.assert_close(got.probs, top[:, :8])
    torch.testing.assert_close(got.confidence, p.max(-1).values)
    torch.testing.assert_close(got.entropy, -(torch.where(top > 0, top * top.log(), 0.0)).sum(-1))


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="1 <= k"):
        draft_distribution(torch.zeros(2, 10), 0)
    with pytest.raises(ValueError, match="m <= 1024"):
        draft_distribution(torch.zeros(2, 2000), 4, 1025)
    with pytest.raises(ValueError, match="rows, vocab"):
        draft_distribution(torch.zeros(10), 2)


def test_dispatch_runs_the_reference_off_gpu():
    logits = make_logits(3, 2048, torch.float32, seed=3)
    got = draft_distribution(logits, 5, 20)
    want = draft_distribution_reference(logits, 5, 20)
    assert torch.equal(got.probs, want.probs)
