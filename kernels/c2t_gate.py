"""C2T's layer selection for the whole batch, in one launch (docs/algorithms.md
section 4, seed 002).

Per request, over its layer of candidates (``[F, C]``: the top-``C``
children of each of its ``F`` frontier nodes): the features of every
candidate, path probability ``P``, its parent's top-M entropy ``H`` and the
layer's depth ``d``; the classifier ``sigmoid(w2 . relu(W1 [P, H, d] + b1) + b2)``
(3-48-1, 241 parameters); the threshold ``conf >= beta``; and the cut to the
``top_k`` most confident survivors (ties: the earlier slot, in (frontier
node, candidate) order). Returns the selection and the confidences.

The Triton kernel runs one program per request: the layer's ``F * C`` slots
(padded to a power of two) are loaded once, the hidden layer is a loop over
its 48 units with the weights read as scalars (the features stay in
registers), and the cut is ``kernels.tree_gating``'s sort of packed
``(conf, -slot)`` keys. The torch reference is what the policy runs on the CPU.
"""

from __future__ import annotations

import torch

from kernels.tree_gating import keep_best

try:
    import triton
    import triton.language as tl

    from kernels.tree_gating import cut_to_best
except ImportError:  # pragma: no cover - triton ships with vLLM
    triton = None


def c2t_confidence(p, entropy, depth: int, w1, b1, w2, b2) -> torch.Tensor:
    """[B, F, C] the classifier's confidence (``entropy`` [B, F]; weights
    ``w1`` [48, 3], ``b1`` [48], ``w2`` [48], ``b2`` [])."""
    features = torch.stack(
        [p.float(), entropy.float().unsqueeze(-1).expand_as(p), torch.full_like(p, float(depth), dtype=torch.float32)],
        dim=-1,
    )
    hidden = torch.relu(features @ w1.float().T + b1.float())
    return torch.sigmoid(hidden @ w2.float() + b2.float())


def c2t_gate_reference(p, entropy, exists, depth: int, w1, b1, w2, b2, beta: float, top_k: int):
    """(chosen [B, F, C] bool, confidence [B, F, C])."""
    confidence = c2t_confidence(p, entropy, depth, w1, b1, w2, b2)
    keep = exists & (confidence >= beta)
    count = torch.full((p.shape[0],), top_k, dtype=torch.long, device=p.device)
    chosen = keep_best(confidence.flatten(1), keep.flatten(1), count).view_as(p)
    return chosen, confidence


if triton is not None:

    @triton.jit
    def _c2t_gate_kernel(
        out_ptr, conf_ptr, p_ptr, entropy_ptr, exists_ptr, w1_ptr, b1_ptr, w2_ptr, b2,
        width_f, width_c, depth, beta, top_k,
        HIDDEN: tl.constexpr, BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        slots = tl.arange(0, BLOCK)
        size = width_f * width_c
        inside = slots < size
        p = tl.load(p_ptr + b * size + slots, mask=inside, other=0.0)
        h = tl.load(entropy_ptr + b * width_f + slots // width_c, mask=inside, other=0.0)
        exists = (tl.load(exists_ptr + b * size + slots, mask=inside, other=0) != 0) & inside
        logit = tl.zeros([BLOCK], dtype=tl.float32) + b2
        for j in range(HIDDEN):
            unit = (p * tl.load(w1_ptr + 3 * j) + h * tl.load(w1_ptr + 3 * j + 1)
                    + depth * tl.load(w1_ptr + 3 * j + 2) + tl.load(b1_ptr + j))
            logit += tl.maximum(unit, 0.0) * tl.load(w2_ptr + j)
        conf = 1.0 / (1.0 + tl.exp(-logit))
        keep = cut_to_best(conf, exists & (conf >= beta), slots, top_k, BLOCK)
        tl.store(out_ptr + b * size + slots, keep.to(tl.int8), mask=inside)
        tl.store(conf_ptr + b * size + slots, conf, mask=inside)


def c2t_gate_triton(p, entropy, exists, depth: int, w1, b1, w2, b2, beta: float, top_k: int):
    batch, width_f, width_c = p.shape
    out = torch.zeros(p.shape, dtype=torch.int8, device=p.device)
    confidence = torch.zeros(p.shape, dtype=torch.float32, device=p.device)
    if batch == 0 or width_f * width_c == 0:
        return out.bool(), confidence
    block = triton.next_power_of_2(width_f * width_c)
    _c2t_gate_kernel[(batch,)](
        out, confidence, p.float().contiguous(), entropy.float().contiguous(), exists.to(torch.int8).contiguous(),
        w1.float().contiguous(), b1.float().contiguous(), w2.float().contiguous(), float(b2),
        width_f, width_c, float(depth), float(beta), min(top_k, block),
        HIDDEN=w1.shape[0], BLOCK=block,
    )
    return out.bool(), confidence


def c2t_gate(p, entropy, exists, depth: int, w1, b1, w2, b2, beta: float, top_k: int):
    """C2T's layer selection and confidences: the Triton kernel on CUDA, the torch reference elsewhere."""
    impl = c2t_gate_triton if triton is not None and p.is_cuda else c2t_gate_reference
    return impl(p, entropy, exists, depth, w1, b1, w2, b2, beta, top_k)
