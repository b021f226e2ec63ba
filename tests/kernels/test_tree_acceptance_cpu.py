"""The native CPU tree acceptance gives ``trees.verify.accept``'s results (the
torch reference) on random trees: chains and branching trees, padded batches,
matches at every depth, no node at all, int32 and int64 target tokens; the
verifier takes it on the CPU where the library is built, the reference
otherwise."""

from __future__ import annotations

import pytest
import torch

from kernels import cpu_library
from kernels.tree_acceptance_cpu import native_accept
from vllm_adaptive_spec.adapter.verifier import acceptance_for
from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch
from vllm_adaptive_spec.trees.verify import accept


def _random_case(rng: torch.Generator, batch: int, max_nodes: int, vocab: int = 4):
    """Random breadth-first trees over a tiny vocabulary (so that many nodes
    match) and target tokens for their rows."""
    trees = []
    for _ in range(batch):
        n = int(torch.randint(0, max_nodes + 1, (1,), generator=rng))
        parents = [-1 if i == 0 or torch.rand(1, generator=rng) < 0.3 else int(torch.randint(0, i, (1,), generator=rng))
                   for i in range(n)]
        tokens = [int(t) for t in torch.randint(0, vocab, (n,), generator=rng)]
        trees.append(DraftTree(tokens, parents, [0.5] * n))
    width = max(len(tree) for tree in trees)
    row_tokens = torch.randint(0, vocab, (batch, width + 1), generator=rng)
    return TreeBatch.from_trees(trees), row_tokens


def _same(got, want) -> None:
    for name in ("num_accepted", "path", "output_tokens"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and torch.equal(a, b), (name, a, b)


@pytest.mark.parametrize("batch,max_nodes", [(1, 1), (1, 16), (8, 4), (8, 16), (64, 16), (3, 0)])
def test_native_acceptance_matches_the_reference(batch, max_nodes):
    accept_native = acceptance_for("cpu")
    assert accept_native is not accept, "the native library did not build on this machine"
    rng = torch.Generator().manual_seed(batch * 100 + max_nodes)
    for _ in range(50):
        tree, row_tokens = _random_case(rng, batch, max_nodes)
        for dtype in (torch.int64, torch.int32):
            _same(accept_native(tree, row_tokens.to(dtype), None), accept(tree, row_tokens.to(dtype)))


def test_a_whole_chain_accepted_and_the_bonus_after_it():
    tree = TreeBatch.from_trees([DraftTree.chain([5, 6, 7]), DraftTree([3, 4], [-1, -1], [0.5, 0.5])])
    row_tokens = torch.tensor([[5, 6, 7, 9], [4, 8, 1, 0]])
    got = acceptance_for("cpu")(tree, row_tokens, None)
    assert got.num_accepted.tolist() == [3, 1]
    assert got.path.tolist() == [[0, 1, 2], [1, -1, -1]]
    assert got.output_tokens.tolist() == [[5, 6, 7, 9], [4, 1, -1, -1]]


def test_the_torch_setting_keeps_the_reference(monkeypatch):
    cpu_library.native_library.cache_clear()
    try:
        monkeypatch.setenv(cpu_library.SETTING, "torch")
        assert native_accept() is None and acceptance_for("cpu") is accept
    finally:
        cpu_library.native_library.cache_clear()
