"""The next tree layer's selection mask for the whole batch, in one launch.

Per request, over its layer of candidates (``[F, C]``: the top-``C``
children of each of its ``F`` frontier nodes, path probabilities ``p``):

* ``talon`` (docs/algorithms.md section 3): the root layer keeps the ``top_k``
  best candidates; a deeper layer keeps every candidate among each node's
  first ``k_c`` whose ``p`` is at least ``mu`` times the layer's largest;
* ``dynatree`` (section 6): a frontier node at depth ``d`` with path
  probability ``P`` is expanded only if ``P >= rho_stop``, ``d < d_max`` and
  (``d < d0`` or ``P >= rho_deep``), into its first ``b_min`` / ``b_mid`` /
  ``b_max`` candidates as its confidence is ``>= tau_h`` / ``>= tau_l`` /
  lower; candidates with ``p < tau`` are dropped;

then the budget cut: at most ``remaining`` candidates per request, the best by
``p`` (ties: the earlier slot, in (frontier node, candidate) order). ``d0``,
``tau_h`` and ``remaining`` are per request (DynaTree's history tuning), so
nothing is read back to the host inside a layer.

The Triton kernel runs one program per request: the layer's ``F * C`` slots
(padded to a power of two) are loaded once, the gates applied in registers,
and the cut is a sort of packed ``(p, -slot)`` keys (``tl.sort``) read at the
``remaining``-th place. The torch references are what the policies run on
the CPU.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton ships with vLLM
    triton = None


def keep_best(p: torch.Tensor, chosen: torch.Tensor, count: torch.Tensor) -> torch.Tensor:
    """[B, M]: the ``count`` [B] chosen slots of highest ``p`` per row (ties: the earlier slot)."""
    score = torch.where(chosen, p, -1.0)
    order = torch.sort(-score, dim=1, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(p.shape[1], device=p.device).expand_as(order))
    return chosen & (rank < count.unsqueeze(1))


def talon_gate_reference(
    p: torch.Tensor, exists: torch.Tensor, remaining: torch.Tensor, root: bool, top_k: int, mu: float, k_c: int
) -> torch.Tensor:
    """[B, F, C] bool selection (``p``, ``exists``: [B, F, C]; ``remaining``: [B])."""
    batch = p.shape[0]
    if root:
        chosen = keep_best(p.flatten(1), exists.flatten(1), torch.full((batch,), top_k, device=p.device)).view_as(p)
    else:
        within = exists[..., :k_c]
        best = torch.where(within, p[..., :k_c], 0.0).flatten(1).amax(1)
        chosen = torch.zeros_like(exists)
        chosen[..., :k_c] = within & (p[..., :k_c] >= mu * best.view(-1, 1, 1))
    return keep_best(p.flatten(1), chosen.flatten(1), remaining).view_as(p)


def dynatree_gate_reference(
    p: torch.Tensor,
    exists: torch.Tensor,
    parent_p: torch.Tensor,
    confidence: torch.Tensor,
    remaining: torch.Tensor,
    d0: torch.Tensor,
    tau_h: torch.Tensor,
    parent_depth: int,
    d_max: int,
    branches: tuple[int, int, int],
    tau_l: float,
    tau: float,
    rho_stop: float,
    rho_deep: float,
) -> torch.Tensor:
    """[B, F, C] bool selection (``parent_p``, ``confidence``: [B, F]; ``remaining``, ``d0``, ``tau_h``: [B])."""
    expand = (parent_p > 0) & (parent_p >= rho_stop) & (parent_depth < d_max)
    expand &= (parent_depth < d0.unsqueeze(1)) | (parent_p >= rho_deep)
    b_min, b_mid, b_max = branches
    width = torch.where(confidence >= tau_h.unsqueeze(1), b_min, torch.where(confidence >= tau_l, b_mid, b_max))
    slot = torch.arange(p.shape[-1], device=p.device)
    chosen = expand.unsqueeze(-1) & (slot < width.unsqueeze(-1)) & exists & (p >= tau)
    return keep_best(p.flatten(1), chosen.flatten(1), remaining).view_as(p)


if triton is not None:

    @triton.jit
    def cut_to_best(p, chosen, slots, remaining, BLOCK: tl.constexpr):
        """``chosen`` slots among the ``remaining`` best by ``p`` (ties: lower slot)."""
        lowest = -9223372036854775807 - 1
        bits = p.to(tl.int32, bitcast=True)  # p >= 0: the bits order as the values
        keys = tl.where(chosen, (bits.to(tl.int64) << 32) | (0xFFFFFFFF - slots.to(tl.int64)), lowest)
        ordered = tl.sort(keys, descending=True)
        lanes = tl.arange(0, BLOCK)
        kth = tl.sum(tl.where(lanes == remaining - 1, ordered, 0), 0)
        return chosen & (keys >= kth) & (remaining > 0)

    @triton.jit
    def _tree_gate_kernel(
        out_ptr,
        p_ptr,
        exists_ptr,
        parent_p_ptr,
        confidence_ptr,
        remaining_ptr,
        d0_ptr,
        tau_h_ptr,
        width_f,
        width_c,
        top_k,
        mu,
        k_c,
        parent_depth,
        d_max,
        b_min,
        b_mid,
        b_max,
        tau_l,
        tau,
        rho_stop,
        rho_deep,
        MODE: tl.constexpr,  # 0: talon root layer, 1: talon deeper layer, 2: dynatree
        BLOCK: tl.constexpr,
    ):
        b = tl.program_id(0)
        slots = tl.arange(0, BLOCK)
        size = width_f * width_c
        inside = slots < size
        node = slots // width_c
        rank = slots % width_c
        p = tl.load(p_ptr + b * size + slots, mask=inside, other=0.0)
        exists = tl.load(exists_ptr + b * size + slots, mask=inside, other=0) != 0
        exists = exists & inside
        remaining = tl.load(remaining_ptr + b)
        if MODE == 0:
            chosen = cut_to_best(p, exists, slots, top_k, BLOCK)
        elif MODE == 1:
            within = exists & (rank < k_c)
            best = tl.max(tl.where(within, p, 0.0), 0)
            chosen = within & (p >= mu * best)
        else:
            parent_p = tl.load(parent_p_ptr + b * width_f + node, mask=inside, other=0.0)
            confidence = tl.load(confidence_ptr + b * width_f + node, mask=inside, other=0.0)
            d0 = tl.load(d0_ptr + b)
            tau_h = tl.load(tau_h_ptr + b)
            expand = (parent_p > 0) & (parent_p >= rho_stop) & (parent_depth < d_max)
            expand = expand & ((parent_depth < d0) | (parent_p >= rho_deep))
            width = tl.where(confidence >= tau_h, b_min, tl.where(confidence >= tau_l, b_mid, b_max))
            chosen = expand & (rank < width) & exists & (p >= tau)
        keep = cut_to_best(p, chosen, slots, remaining, BLOCK)
        tl.store(out_ptr + b * size + slots, keep.to(tl.int8), mask=inside)


def _launch(mode: int, p, exists, remaining, parent_p=None, confidence=None, d0=None, tau_h=None, **scalars):
    batch, width_f, width_c = p.shape
    out = torch.zeros(p.shape, dtype=torch.int8, device=p.device)
    if batch == 0 or width_f * width_c == 0:
        return out.bool()
    dummy = torch.zeros(1, device=p.device)
    ints = torch.zeros(batch, dtype=torch.int32, device=p.device)
    _tree_gate_kernel[(batch,)](
        out,
        p.float().contiguous(),
        exists.to(torch.int8).contiguous(),
        dummy if parent_p is None else parent_p.float().contiguous(),
        dummy if confidence is None else confidence.float().contiguous(),
        remaining.to(torch.int32).contiguous(),
        ints if d0 is None else d0.to(torch.int32).contiguous(),
        dummy if tau_h is None else tau_h.float().contiguous(),
        width_f,
        width_c,
        scalars.get("top_k", 0),
        float(scalars.get("mu", 0.0)),
        scalars.get("k_c", 0),
        scalars.get("parent_depth", 0),
        scalars.get("d_max", 0),
        *scalars.get("branches", (0, 0, 0)),
        float(scalars.get("tau_l", 0.0)),
        float(scalars.get("tau", 0.0)),
        float(scalars.get("rho_stop", 0.0)),
        float(scalars.get("rho_deep", 0.0)),
        MODE=mode,
        BLOCK=triton.next_power_of_2(width_f * width_c),
    )
    return out.bool()


def talon_gate_triton(p, exists, remaining, root, top_k, mu, k_c):
    return _launch(0 if root else 1, p, exists, remaining, top_k=top_k, mu=mu, k_c=k_c)


def dynatree_gate_triton(p, exists, parent_p, confidence, remaining, d0, tau_h, parent_depth, d_max, branches,
                         tau_l, tau, rho_stop, rho_deep):
    return _launch(2, p, exists, remaining, parent_p, confidence, d0, tau_h, parent_depth=parent_depth,
                   d_max=d_max, branches=branches, tau_l=tau_l, tau=tau, rho_stop=rho_stop, rho_deep=rho_deep)


def _on_gpu(tensor: torch.Tensor) -> bool:
    return triton is not None and tensor.is_cuda


def talon_gate(p, exists, remaining, root, top_k, mu, k_c) -> torch.Tensor:
    """TALON's layer selection: the Triton kernel on CUDA, the torch reference elsewhere."""
    impl = talon_gate_triton if _on_gpu(p) else talon_gate_reference
    return impl(p, exists, remaining, root, top_k, mu, k_c)


def dynatree_gate(p, exists, parent_p, confidence, remaining, d0, tau_h, parent_depth, d_max, branches,
                  tau_l, tau, rho_stop, rho_deep) -> torch.Tensor:
    """DynaTree's layer selection: the Triton kernel on CUDA, the torch reference elsewhere."""
    impl = dynatree_gate_triton if _on_gpu(p) else dynatree_gate_reference
    return impl(p, exists, parent_p, confidence, remaining, d0, tau_h, parent_depth, d_max, branches,
                tau_l, tau, rho_stop, rho_deep)
