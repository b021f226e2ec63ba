"""C2T's fused gate (features, the 3-48-1 classifier, threshold, per-request
top-K; interpreted off GPU) against its torch reference, and the reference
against the classifier written as an ``nn.Sequential``."""

from __future__ import annotations

import pytest
import torch

from kernels.c2t_gate import c2t_confidence, c2t_gate_reference, c2t_gate_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def classifier(seed: int):
    gen = torch.Generator().manual_seed(seed)
    net = torch.nn.Sequential(torch.nn.Linear(3, 48), torch.nn.ReLU(), torch.nn.Linear(48, 1))
    with torch.no_grad():
        for param in net.parameters():
            param.copy_(torch.randn(param.shape, generator=gen))
    return net, (net[0].weight.detach(), net[0].bias.detach(), net[2].weight.detach()[0], net[2].bias.detach()[0])


def layer(seed: int, batch: int = 3, width_f: int = 4, width_c: int = 7):
    """A layer of ``width_f * width_c`` = 28 slots: not a power of two, so the
    kernel's padded lanes are exercised, yet one 32-lane sort (the interpreter
    runs a sort element by element, so the layer is kept small)."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.rand(batch, width_f, width_c, generator=gen).sort(-1, descending=True).values
    parent_p = torch.rand(batch, width_f, generator=gen) ** 2
    parent_p[1, width_f // 2:] = 0.0  # empty frontier slots
    p = parent_p.unsqueeze(-1) * q
    entropy = 4 * torch.rand(batch, width_f, generator=gen)
    exists = (p > 0) & (torch.rand(p.shape, generator=gen) > 0.1)
    return p, entropy, exists


def test_reference_confidence_is_the_classifier():
    net, weights = classifier(0)
    p, entropy, _ = layer(0)
    features = torch.stack([p, entropy.unsqueeze(-1).expand_as(p), torch.full_like(p, 3.0)], -1)
    assert torch.allclose(c2t_confidence(p, entropy, 3, *weights), torch.sigmoid(net(features))[..., 0], atol=1e-6)


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("beta, top_k, depth", [(0.5, 10, 1), (0.2, 3, 4), (0.9, 100, 2), (0.5, 0, 1)])
def test_kernel_matches_the_reference(seed, beta, top_k, depth):
    _, weights = classifier(seed)
    p, entropy, exists = layer(seed)
    want, want_conf = c2t_gate_reference(p, entropy, exists, depth, *weights, beta, top_k)
    args = [t.to(DEVICE) for t in (p, entropy, exists)]
    got, got_conf = c2t_gate_triton(*args, depth, *(w.to(DEVICE) for w in weights), beta, top_k)
    assert torch.allclose(got_conf.cpu(), want_conf, atol=1e-5)
    assert torch.equal(got.cpu(), want)
    assert int(want.sum()) > 0 or top_k == 0 or beta == 0.9


def test_ties_go_to_the_earlier_slot():
    weights = (torch.zeros(48, 3), torch.zeros(48), torch.zeros(48), torch.tensor(0.0))  # conf = 0.5 everywhere
    p, entropy, exists = layer(1, batch=2)
    exists = torch.ones_like(exists)
    want, _ = c2t_gate_reference(p, entropy, exists, 1, *weights, 0.5, 7)
    got, _ = c2t_gate_triton(*(t.to(DEVICE) for t in (p, entropy, exists)), 1, *(w.to(DEVICE) for w in weights), 0.5, 7)
    assert torch.equal(got.cpu(), want)
    assert want.flatten(1)[:, :7].all() and not want.flatten(1)[:, 7:].any()
