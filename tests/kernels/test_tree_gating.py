"""The fused layer-gating kernel (interpreted off GPU) against its torch
references: TALON's root top-K, gate and cut to each tree's node limit, and DynaTree's
confidence branching and depth gates, with per-request settings, ties,
missing candidates and node limits of 0 and beyond the layer."""

from __future__ import annotations

import pytest
import torch

from kernels.tree_gating import (
    dynatree_gate_reference,
    dynatree_gate_triton,
    keep_best,
    talon_gate_reference,
    talon_gate_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def layer(seed: int, batch: int = 5, width_f: int = 5, width_c: int = 6):
    """A layer of ``width_f * width_c`` candidates a request (30 by default:
    not a power of two, so the kernel's padded lanes are exercised, yet one
    32-lane sort; the interpreter sorts element by element, so layers are kept
    small). Request 0 is all ties (quarter steps under one parent probability,
    within and across frontier nodes) under a node limit that cuts through them;
    request 1 has empty frontier slots; request 2 a limit of 0; request 3 a
    limit beyond the layer (and the padded block); request 4 a limit that
    cuts. About one candidate in ten is missing while its ``p`` is positive,
    so the ``exists`` mask is what drops it."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(batch, width_f, width_c, generator=gen).sort(-1, descending=True).values
    q = torch.where(torch.rand(batch, width_f, width_c, generator=gen) < 0.1, 0.0, q).sort(-1, descending=True).values
    q[0] = (q[0] * 4).round() / 4  # many ties
    parent_p = torch.rand(batch, width_f, generator=gen) ** 3
    parent_p[0] = 0.5  # ties across frontier nodes too
    parent_p[1, width_f // 2:] = 0.0  # empty frontier slots
    p = parent_p.unsqueeze(-1) * q
    exists = (q > 0) & (torch.rand(batch, width_f, width_c, generator=gen) >= 0.1)
    remaining = torch.tensor([5, 3, 0, 1000, 9][:batch])
    return q, p, parent_p, exists, remaining


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("root, mu", [(True, 0.03), (False, 0.03), (False, 0.5)])
def test_talon_kernel_matches_the_reference(seed, root, mu):
    _, p, _, exists, remaining = layer(seed)
    exists &= p > 0
    args = (remaining, root, 8, mu, 4)
    want = talon_gate_reference(p, exists, *args)
    got = talon_gate_triton(p.to(DEVICE), exists.to(DEVICE), remaining.to(DEVICE), *args[1:])
    assert torch.equal(got.cpu(), want)
    assert want.flatten(1).sum(1).le(remaining).all() and not want[2].any()


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("parent_depth", [0, 2, 5])
def test_dynatree_kernel_matches_the_reference(seed, parent_depth):
    q, p, parent_p, exists, remaining = layer(seed, width_f=10, width_c=3)
    confidence = q[..., 0]
    d0 = torch.tensor([5, 1, 3, 2, 6])
    tau_h = torch.tensor([0.9, 0.5, 0.7, 0.95, 0.6])
    settings = (parent_depth, 5, (1, 2, 3), 0.4, 0.03, 0.01, 0.1)
    want = dynatree_gate_reference(p, exists, parent_p, confidence, remaining, d0, tau_h, *settings)
    got = dynatree_gate_triton(*(x.to(DEVICE) for x in (p, exists, parent_p, confidence, remaining, d0, tau_h)),
                               *settings)
    assert torch.equal(got.cpu(), want)
    if parent_depth == 5:  # d_max reached: nothing expands
        assert not want.any()


def test_references_follow_their_rules_on_a_small_example():
    # One request, two frontier nodes; p = [[0.5, 0.3, 0.1], [0.2, 0.2, 0.01]].
    p = torch.tensor([[[0.5, 0.3, 0.1], [0.2, 0.2, 0.01]]])
    exists = p > 0
    gate = talon_gate_reference(p, exists, torch.tensor([10]), False, 10, 0.25, 3)
    assert gate.tolist() == [[[True, True, False], [True, True, False]]]  # p >= 0.125
    cut = talon_gate_reference(p, exists, torch.tensor([3]), False, 10, 0.25, 3)
    assert cut.tolist() == [[[True, True, False], [True, False, False]]]  # the tie goes to the earlier slot
    root = talon_gate_reference(p, exists, torch.tensor([10]), True, 2, 0.25, 3)
    assert root.tolist() == [[[True, True, False], [False, False, False]]]
    conf = torch.tensor([[0.95, 0.3]])  # node 0 is sure (1 child), node 1 is not (3 children)
    dyna = dynatree_gate_reference(p, exists, torch.tensor([[1.0, 1.0]]), conf, torch.tensor([10]),
                                   torch.tensor([5]), torch.tensor([0.9]), 0, 8, (1, 2, 3), 0.4, 0.05, 0.01, 0.1)
    assert dyna.tolist() == [[[True, False, False], [True, True, False]]]  # 0.01 < tau = 0.05


def test_keep_best_keeps_the_count_best_with_ties_to_the_earlier_slot():
    p = torch.tensor([[0.2, 0.5, 0.2, 0.2, 0.1]])
    chosen = torch.tensor([[True, True, True, False, True]])
    assert keep_best(p, chosen, torch.tensor([2])).tolist() == [[True, True, False, False, False]]
    assert keep_best(p, chosen, torch.tensor([0])).sum() == 0
