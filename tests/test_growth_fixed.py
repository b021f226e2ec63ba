"""Tree growth at fixed capacity: the same trees as the
ragged layer loop for every model-drafter policy whenever the width holds
each layer, trees cut to the capacity otherwise (still trees), traced whole
by ``torch.compile(fullgraph=True)``, the same operations at every batch
size and node limit."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from dispatched_ops import dispatched, reads
from test_model_drafter import TableBackend

from vllm_adaptive_spec.drafters.model import Eagle3Drafter
from vllm_adaptive_spec.policies import C2TPolicy, ChainPolicy, DeaglePolicy, DynaTreePolicy, Eagle2Policy, TalonPolicy
from vllm_adaptive_spec.trees.candidates import Candidates, Growth
from vllm_adaptive_spec.step.growth import grow, grow_fixed

VOCAB = 1024  # C2T's classifier reads a top-1000 entropy
CLASSIFIER = Path(__file__).parent.parent / "heads" / "smollm2-135m-eagle3" / "c2t_classifier.json"
POLICIES = {
    "chain": lambda: ChainPolicy(),
    "eagle2": lambda: Eagle2Policy(top_k=4, depth=5),
    "talon": lambda: TalonPolicy(top_k=4, k_c=4, max_depth=10),
    "deagle": lambda: DeaglePolicy(top_k=4, depth=8),
    "dynatree": lambda: DynaTreePolicy(),
    "c2t": lambda: C2TPolicy(top_k=4, max_depth=6, classifier=str(CLASSIFIER)),
}


def tables(seed: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Peaked distributions over a few likely tokens, so trees branch and deepen."""
    gen = torch.Generator().manual_seed(seed)
    roots = (torch.randn(batch, VOCAB, generator=gen) * 4).softmax(-1)
    table = (torch.randn(VOCAB, VOCAB, generator=gen) * 4).softmax(-1)
    return roots, table


def grown(policy, roots, table, max_nodes: torch.Tensor, width: int | None):
    """The trees of the ragged loop (``width`` None) or of the fixed one."""
    batch = max_nodes.shape[0]
    drafter = Eagle3Drafter()
    drafter.bind(TableBackend(roots, table), policy.fanout, policy.entropy_top_m)
    ids = [f"r{b}" for b in range(batch)]
    drafter.prepare(ids, [None] * batch, list(range(batch)))
    policy.begin(ids)
    if width is None:
        return grow(drafter, policy, max_nodes, drafter.max_depth)[0]
    depth = min(drafter.max_depth, policy.depth_limit(int(max_nodes.max())))
    return grow_fixed(drafter, policy, max_nodes, depth, width).to_trees()


@pytest.mark.parametrize("name", list(POLICIES))
def test_the_same_trees_as_the_ragged_loop(name):
    max_nodes = torch.tensor([16, 5, 0, 24])
    for seed in range(4):
        roots, table = tables(seed, 4)
        policy = POLICIES[name]()
        width = policy.layer_width(int(max_nodes.max()))
        ragged = grown(policy, roots, table, max_nodes, None)
        assert grown(POLICIES[name](), roots, table, max_nodes, width) == ragged
        assert sum(len(t) for t in ragged) > 8


def test_a_width_too_narrow_cuts_the_trees_to_their_capacity():
    roots, table = tables(5, 3)
    max_nodes = torch.tensor([24, 24, 24])
    full = grown(TalonPolicy(top_k=4, k_c=4), roots, table, max_nodes, 24)
    cut = grown(TalonPolicy(top_k=4, k_c=4), roots, table, max_nodes, 2)
    for small, large in zip(cut, full):
        small.validate()
        widest = max(Counter(small.depths()).values())
        assert widest <= 2 < max(Counter(large.depths()).values()) and small.tokens[:2] == large.tokens[:2]


class TableDrafter:
    """A drafter of tensor operations only (a node's handle is its token):
    its children are the top-``fanout`` tokens of its row of the table."""

    growth = Growth.LAYERS

    def __init__(self, roots: torch.Tensor, table: torch.Tensor, fanout: int) -> None:
        self.roots, self.table, self.fanout = roots, table, fanout

    def expand(self, handles: torch.Tensor, live: torch.Tensor) -> Candidates:
        rows = torch.where((handles < 0).unsqueeze(-1), self.roots.unsqueeze(1), self.table[handles.clamp(min=0)])
        q, tokens = rows.topk(self.fanout, dim=-1)
        q = torch.where(live.unsqueeze(-1), q, 0.0)
        return Candidates(tokens=tokens, q=q, handles=tokens.clone())


def fixed_trees(roots, table, max_nodes):
    policy = TalonPolicy(top_k=4, k_c=4, max_depth=6)
    return grow_fixed(TableDrafter(roots, table, policy.fanout), policy, max_nodes, 6, 8)


def test_the_fixed_loop_compiles_whole_and_equals_eager():
    torch._dynamo.reset()
    roots, table = tables(1, 4)
    max_nodes = torch.tensor([8, 3, 0, 8])
    compiled = torch.compile(fixed_trees, fullgraph=True, dynamic=False, backend="aot_eager")
    eager, traced = fixed_trees(roots, table, max_nodes), compiled(roots, table, max_nodes)
    for got, want in zip(traced, eager):
        assert (got is None and want is None) or torch.equal(got, want)
    assert eager.num_nodes.tolist()[2] == 0 and eager.num_nodes.sum() > 8


def test_the_same_operations_at_every_batch_and_budget():
    counts = []
    for batch, max_nodes in ((8, 4), (64, 4), (8, 8), (64, 8)):
        roots, table = tables(batch, batch)
        counts.append(dispatched(fixed_trees, roots, table, torch.full((batch,), max_nodes)))
    assert all(count == counts[0] for count in counts)
    assert not reads(counts[0])


def test_the_trees_reach_the_host_in_one_read(monkeypatch):
    """Every field of the grown trees in one copy (on a GPU, one
    synchronisation a drafting step), the same trees as reading each field,
    the draft probabilities and entropies bit for bit."""
    roots, table = tables(2, 4)
    policy = C2TPolicy(top_k=4, max_depth=6, classifier=str(CLASSIFIER))
    drafter = Eagle3Drafter()
    drafter.bind(TableBackend(roots, table), policy.fanout, policy.entropy_top_m)
    drafter.prepare([f"r{b}" for b in range(4)], [None] * 4, list(range(4)))
    policy.begin([f"r{b}" for b in range(4)])
    trees = grow_fixed(drafter, policy, torch.tensor([16, 5, 0, 24]), 6, policy.layer_width(24))
    fields = [x.tolist() for x in (trees.tokens, trees.parents, trees.q, trees.entropy, trees.num_nodes)]
    reads = []
    for name in ("tolist", "cpu", "item", "numpy"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _f=original, _n=name, **k: reads.append(_n) or _f(self, *a, **k))
    got = trees.to_trees()
    assert reads == ["cpu", "numpy"]  # the packed copy, then its host view
    assert sum(len(tree) for tree in got) > 8
    for b, tree in enumerate(got):
        n = fields[4][b]
        assert (tree.tokens, tree.parents, tree.q, tree.parent_entropy) == tuple(f[b][:n] for f in fields[:4])
