"""What tree policies read from a draft distribution, in one pass over each row.

From a draft pass's logits ``[R, V]`` (one row per frontier node), per row:
the softmax normaliser, the top-``k`` tokens and their probabilities (ties:
the lower token id first), the largest probability (the node's confidence,
DynaTree) and the entropy ``-sum p log p`` over the top ``m`` probabilities
(C2T's feature, docs/algorithms.md section 4; natural log, not renormalised;
``m = 0`` skips it). The dense probabilities are never written.

The Triton kernel runs one program per row over tiles of the vocabulary. One
pass keeps an online maximum and sum of exponentials and a running top-``k``
list of packed keys (the float's order-preserving bits in the high 32 bits,
the complemented token id in the low 32, so ties go to the lower id): a
tile's best keys enter the list one at a time, and only while they beat its
worst, so most tiles cost one maximum. The top-``m`` entropy (``m`` up to
1024) is found without sorting: four radix passes over the row (8 bits of
the 32-bit key each, ``tl.histogram``) give the ``m``-th largest logit
exactly, and a last pass sums ``-p log p`` above it (ties at the threshold
counted as many times as they fall inside the top ``m``).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with vLLM
    triton = None

MAX_K = 64  # the most top tokens per row
MAX_M = 1024  # the most top probabilities in the entropy


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
    if not 1 <= k <= min(MAX_K, logits.shape[1]) or not 0 <= m <= min(MAX_M, logits.shape[1]):
        raise ValueError(f"need 1 <= k <= {MAX_K} and 0 <= m <= {MAX_M}, both within the vocabulary; got {k}, {m}")


def draft_distribution_reference(logits: torch.Tensor, k: int, m: int = 0) -> DraftDistribution:
    """The torch reference (float32), also what runs off CUDA. The top tokens
    are taken from the dense softmax (probabilities order as the logits do;
    equal ones keep the lower token id first): one fused softmax and one
    selection, where a ``logsumexp`` beside a ``topk`` of the logits costs
    several more operations a pass, and a draft pass on the CPU is paid in
    operations. ``k = 1`` without entropy (a chain's pass) is one maximum."""
    _check(logits, k, m)
    probs = torch.softmax(logits.float(), dim=-1)
    if k == 1 and m == 0:
        top, tokens = probs.max(dim=-1, keepdim=True)
    else:
        top, tokens = probs.topk(max(k, m), dim=-1)
    if m == 0:  # no entropy asked for (a model drafter's every layer): the top k are all there is, nothing to cut
        return DraftDistribution(tokens, top, top[:, 0], top.new_zeros(top.shape[0]))
    top_m = top[:, :m]
    entropy = -torch.where(top_m > 0, top_m * torch.log(top_m), 0.0).sum(-1)
    return DraftDistribution(tokens[:, :k], top[:, :k], top[:, 0], entropy)


if triton is not None:

    @triton.jit
    def _ordered(values):
        """int32 bits of float32 ``values`` that order as the values do."""
        bits = values.to(tl.int32, bitcast=True)
        return tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)

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
        base = logits_ptr + row * stride_row
        lowest = -9223372036854775807 - 1
        lanes = tl.arange(0, W)
        best = lowest + lanes.to(tl.int64)  # distinct sentinels below every real key
        running_max = float("-inf")
        running_sum = 0.0
        for start in range(0, vocab, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            inside = offs < vocab
            x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            safe_max = tl.where(new_max == float("-inf"), 0.0, new_max)  # no NaN while all is -inf
            running_sum = running_sum * tl.exp(running_max - safe_max) + tl.sum(tl.exp(x - safe_max), 0)
            running_max = new_max
            keys = (_ordered(x).to(tl.int64) << 32) | (0xFFFFFFFF - offs.to(tl.int64))
            keys = tl.where(inside, keys, lowest)
            top = tl.max(keys, 0)
            worst = tl.min(best, 0)
            while top > worst:
                best = tl.where(best == worst, top, best)
                keys = tl.where(keys == top, lowest, keys)
                top = tl.max(keys, 0)
                worst = tl.min(best, 0)
        # best holds the top W keys in no order: rank them (W <= 64, a W x W comparison).
        rank = tl.sum((best[None, :] > best[:, None]).to(tl.int32), 1)
        values = ((best >> 32).to(tl.int32))
        values = tl.where(values >= 0, values, values ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
        ids = 0xFFFFFFFF - (best & 0xFFFFFFFF)
        probs = tl.exp(values - running_max) / running_sum
        tl.store(tokens_ptr + row * K + rank, ids, mask=rank < K)
        tl.store(probs_ptr + row * K + rank, probs, mask=rank < K)
        tl.store(confidence_ptr + row, tl.sum(tl.where(rank == 0, probs, 0.0), 0))
        entropy = 0.0
        if M > 0:
            # Radix select of the M-th largest key (as unsigned 32 bits), 8 bits a pass.
            prefix = tl.zeros((), tl.int64)
            need = M
            bins = tl.arange(0, 256)
            for shift in tl.static_range(24, -8, -8):
                counts = tl.zeros((256,), tl.int32)
                for start in range(0, vocab, BLOCK_V):
                    offs = start + tl.arange(0, BLOCK_V)
                    inside = offs < vocab
                    x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
                    unsigned = _ordered(x).to(tl.int64) + 2147483648
                    match = inside & ((unsigned >> (shift + 8)) == (prefix >> (shift + 8)))
                    digit = ((unsigned >> shift) & 255).to(tl.int32)
                    counts += tl.histogram(digit, 256, mask=match)
                above = tl.cumsum(counts, 0, reverse=True) - counts  # matching keys with a larger digit
                here = (above < need) & (above + counts >= need)
                prefix = prefix | (tl.sum(tl.where(here, bins, 0), 0).to(tl.int64) << shift)
                need = need - tl.sum(tl.where(here, above, 0), 0)
            threshold = (prefix - 2147483648).to(tl.int32)
            threshold = tl.where(threshold >= 0, threshold, threshold ^ 0x7FFFFFFF).to(tl.float32, bitcast=True)
            p_at = tl.exp(threshold - running_max) / running_sum
            entropy = tl.where(p_at > 0, -p_at * tl.log(tl.where(p_at > 0, p_at, 1.0)), 0.0) * need
            for start in range(0, vocab, BLOCK_V):
                offs = start + tl.arange(0, BLOCK_V)
                inside = offs < vocab
                x = tl.load(base + offs, mask=inside, other=float("-inf")).to(tl.float32)
                p = tl.exp(x - running_max) / running_sum
                above_threshold = (_ordered(x).to(tl.int64) + 2147483648) > prefix
                terms = tl.where(inside & above_threshold & (p > 0), -p * tl.log(tl.where(p > 0, p, 1.0)), 0.0)
                entropy += tl.sum(terms, 0)
        tl.store(entropy_ptr + row, entropy)


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
        logits = logits if logits.stride(1) == 1 else logits.contiguous()
        _draft_distribution_kernel[(rows,)](
            logits, tokens, probs, confidence, entropy, vocab, logits.stride(0),
            K=k, M=m, W=max(triton.next_power_of_2(k), 2), BLOCK_V=block_v,
        )
    return DraftDistribution(tokens, probs, confidence, entropy)


def draft_distribution(logits: torch.Tensor, k: int, m: int = 0) -> DraftDistribution:
    """The Triton kernel on CUDA, the torch reference elsewhere."""
    impl = draft_distribution_triton if triton is not None and logits.is_cuda else draft_distribution_reference
    return impl(logits, k, m)
