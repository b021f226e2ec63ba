"""What tree policies read from a draft distribution, in one pass over each row.

From a draft pass's logits ``[R, V]`` (one row per frontier node), per row:
the softmax normaliser, the top-``k`` tokens and their probabilities (ties:
the lower token id first), the largest probability (the node's confidence,
DynaTree) and the entropy ``-sum p log p`` over the top ``m`` probabilities
(C2T's feature, ALGORITHMS.md section 4; natural log, not renormalised;
``m = 0`` skips it). The dense probabilities are never written.

The Triton kernel runs one program per row over tiles of the vocabulary,
keeping an online maximum and sum of exponentials and a running top list:
each tile's best ``W = next_pow2(max(k, m))`` logits are merged with it by one
``tl.topk`` over packed keys (the float's order-preserving bits in the high
32 bits, the complemented token id in the low 32, so ties go to the lower
id). Decision: ``m`` up to 1024 uses the same running list; for C2T's
``m = 1000`` that makes each tile's merge a sort of 2048 keys, correct but
not the fastest way to the top-1000 entropy.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with vLLM
    triton = None

MAX_TOP = 1024  # the most top probabilities (k or m) one row may ask for


class DraftDistribution(NamedTuple):
    """``tokens``/``probs`` [R, k] by descending probability; ``confidence``
    and ``entropy`` [R] (entropy 0 when not asked for)."""

    tokens: torch.Tensor
    probs: torch.Tensor
    confidence: torch.Tensor
    entropy: torch.Tensor


def _check(logits: torch.Tensor, k: int, m: int) -> None:
    if logits.dim() != 2:
        raise ValueError(f"logits must be [rows, vocab], got shape {tuple(logits.shape)}")
    if not 1 <= k <= min(MAX_TOP, logits.shape[1]) or not 0 <= m <= min(MAX_TOP, logits.shape[1]):
        raise ValueError(f"need 1 <= k <= {MAX_TOP} and 0 <= m <= {MAX_TOP}, both within the vocabulary; got {k}, {m}")


def draft_distribution_reference(logits: torch.Tensor, k: int, m: int = 0) -> DraftDistribution:
    """The torch reference (float32)."""
    _check(logits, k, m)
    x = logits.float()
    log_norm = torch.logsumexp(x, dim=-1, keepdim=True)
    values, tokens = x.topk(max(k, m), dim=-1)
    probs = torch.exp(values - log_norm)
    top_m = probs[:, :m]
    entropy = -torch.where(top_m > 0, top_m * torch.log(top_m), 0.0).sum(-1)
    return DraftDistribution(tokens[:, :k], probs[:, :k], probs[:, 0], entropy)


if triton is not None:

    @triton.jit
    def _pack(values, ids):
        """int64 keys that sort as (value, -id)."""
        bits = values.to(tl.int32, bitcast=True)
        ordered = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)
        return (ordered.to(tl.int64) << 32) | (0xFFFFFFFF - ids.to(tl.int64))

    @triton.jit
    def _unpack(keys):
        ordered = (keys >> 32).to(tl.int32)
        bits = tl.where(ordered >= 0, ordered, ordered ^ 0x7FFFFFFF)
        ids = (0xFFFFFFFF - (keys & 0xFFFFFFFF)).to(tl.int32)
        return bits.to(tl.float32, bitcast=True), ids

    @triton.jit
    def _draft_distribution_kernel(
        logits_ptr,
        tokens_ptr,
        probs_ptr,
        confidence_ptr,
        entropy_ptr,
        vocab,
        stride_row,
        K: tl.constexpr,
        M: tl.constexpr,
        W: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        row = tl.program_id(0)
        lowest = -9223372036854775807 - 1
        best = tl.full((W,), lowest, tl.int64)
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inside = offs < vocab
            x = tl.load(logits_ptr + row * stride_row + offs, mask=inside, other=float("-inf")).to(tl.float32)
            tile_max = tl.max(x, 0)
            new_max = tl.maximum(running_max, tile_max)
            # A row still at -inf everywhere adds nothing (and must not make NaNs).
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)
            running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(x - safe_max), 0)
            running_max = new_max
            keys = tl.where(inside, _pack(x, offs), lowest)
            tile_best = tl.topk(keys, W)
            best = tl.topk(tl.reshape(tl.join(best, tile_best), (2 * W,)), W)
        values, ids = _unpack(best)
        probs = tl.exp(values - running_max) / running_sum
        lanes = tl.arange(0, W)
        tl.store(tokens_ptr + row * K + lanes, ids.to(tl.int64), mask=lanes < K)
        tl.store(probs_ptr + row * K + lanes, probs, mask=lanes < K)
        tl.store(confidence_ptr + row, tl.sum(tl.where(lanes == 0, probs, 0.0), 0))
        terms = tl.where((lanes < M) & (probs > 0), -probs * tl.log(tl.where(probs > 0, probs, 1.0)), 0.0)
        tl.store(entropy_ptr + row, tl.sum(terms, 0))


def draft_distribution_triton(logits: torch.Tensor, k: int, m: int = 0, block_v: int = 1024) -> DraftDistribution:
    """Launch the kernel, one program per row (``block_v``: the vocabulary tile, a power of two)."""
    _check(logits, k, m)
    rows, vocab = logits.shape
    device = logits.device
    tokens = torch.empty(rows, k, dtype=torch.long, device=device)
    probs = torch.empty(rows, k, dtype=torch.float32, device=device)
    confidence = torch.empty(rows, dtype=torch.float32, device=device)
    entropy = torch.empty(rows, dtype=torch.float32, device=device)
    if rows:
        width = triton.next_power_of_2(max(k, m))
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _draft_distribution_kernel[(rows,)](
            logits, tokens, probs, confidence, entropy, vocab, logits.stride(0),
            K=k, M=m, W=width, BLOCK_V=max(block_v, width),
        )
    return DraftDistribution(tokens, probs, confidence, entropy)


def draft_distribution(logits: torch.Tensor, k: int, m: int = 0) -> DraftDistribution:
    """The Triton kernel on CUDA, the torch reference elsewhere."""
    impl = draft_distribution_triton if triton is not None and logits.is_cuda else draft_distribution_reference
    return impl(logits, k, m)
