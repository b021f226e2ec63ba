"""The retrieval drafter (docs/algorithms.md section 7), driven through grow()."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch

from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter
from vllm_adaptive_spec.policies import ChainPolicy, RetrievalPolicy
from vllm_adaptive_spec.trees.candidates import Growth
from vllm_adaptive_spec.step.growth import grow
from vllm_adaptive_spec.trees.tree import DraftTree

CONTEXT = [1, 2, 3, 4, 9, 1, 2, 3, 5, 9, 1, 2, 3]


def draft(drafter, contexts, max_nodes=100, policy=None, ids=None):
    ids = ids or [f"r{i}" for i in range(len(contexts))]
    drafter.prepare(ids, Contexts.of(contexts))
    trees, _ = grow(drafter, policy or RetrievalPolicy(), torch.full((len(contexts),), max_nodes), drafter.max_depth)
    return trees


def paths(tree: DraftTree) -> dict[tuple[int, ...], float]:
    """Each node as its token path from the root -> q."""
    out: dict[tuple[int, ...], float] = {}
    keys: list[tuple[int, ...]] = []
    for token, parent, q in zip(tree.tokens, tree.parents, tree.q):
        keys.append((keys[parent] if parent >= 0 else ()) + (token,))
        out[keys[-1]] = q
    return out


def naive_paths(context, l_max, l_min, max_matches, max_depth, evidence_prior=0.0) -> dict[tuple[int, ...], float]:
    """Longest repeated suffix (length k, l_max down to l_min), its latest
    ``max_matches`` earlier occurrences, continuation counts c; a path's last
    node gets q = (c / n) * c / (c + kappa), n its siblings' total count and
    kappa = evidence_prior * (k + depth of its parent) ** -1.3."""
    n, starts, match = len(context), [], 0
    for k in range(min(l_max, n), l_min - 1, -1):
        starts = [i + k for i in range(n - k) if context[i:i + k] == context[n - k:]][-max_matches:]
        if starts:
            match = k
            break
    counts = Counter(tuple(context[s:s + d]) for s in starts for d in range(1, min(max_depth, n - s) + 1))

    def q(path, c):
        total = sum(c2 for p2, c2 in counts.items() if p2[:-1] == path[:-1])
        kappa = evidence_prior * (match + len(path) - 1) ** -1.3
        return c / total * c / (c + kappa)

    return {path: q(path, c) for path, c in counts.items()}


def test_example_two_continuations():
    tree = draft(RetrievalDrafter(l_max=3, evidence_prior=0), [CONTEXT])[0]
    tree.validate()
    # [1, 2, 3] was followed by 4 9 1 2 3 5 9 1 2 3 and (more recently) by 5 9 1 2 3.
    assert tree.tokens[:2] == [5, 4] and tree.q[:2] == [0.5, 0.5]
    assert paths(tree) == pytest.approx(naive_paths(CONTEXT, 3, 1, 32, 16))
    assert max(tree.depths()) == 10
    chain = draft(RetrievalDrafter(l_max=3), [CONTEXT], max_nodes=3, policy=ChainPolicy())[0]
    assert (chain.tokens, chain.parents) == ([5, 9, 1], [-1, 0, 1])


def test_longest_suffix_wins():
    # Suffix [5, 6, 7] was followed by 8; the 1-token suffix [7] also by 9.
    context = [5, 6, 7, 8, 0, 7, 9, 5, 6, 7]
    assert paths(draft(RetrievalDrafter(l_max=3, evidence_prior=0), [context])[0]) == {
        (8,): 1.0, (8, 0): 1.0, (8, 0, 7): 1.0, (8, 0, 7, 9): 1.0, (8, 0, 7, 9, 5): 1.0,
        (8, 0, 7, 9, 5, 6): 1.0, (8, 0, 7, 9, 5, 6, 7): 1.0,
    }
    short = paths(draft(RetrievalDrafter(l_max=1, evidence_prior=0), [context])[0])  # l_max honoured
    assert {path: q for path, q in short.items() if len(path) == 1} == {(9,): 0.5, (8,): 0.5}


def test_evidence_lowers_q_of_thin_matches():
    """One occurrence after a 1-token match: q = 1 / (1 + evidence_prior) (the
    default's); deeper nodes have more matched context, so q rises along the path."""
    drafter = RetrievalDrafter()
    tree = draft(drafter, [[1, 2, 3, 4, 1]], policy=RetrievalPolicy(min_p=0.0))[0]
    assert tree.tokens == [2, 3, 4, 1]
    assert drafter.evidence_prior == 4.0
    assert tree.q == pytest.approx([1 / (1 + 4.0 * k ** -1.3) for k in (1, 2, 3, 4)], rel=1e-6)


def test_l_min():
    context = [1, 2, 3, 4, 1]  # only the 1-token suffix [1] repeats
    assert len(draft(RetrievalDrafter(l_min=2, evidence_prior=0), [context])[0]) == 0
    assert draft(RetrievalDrafter(l_min=1, evidence_prior=0), [context])[0].tokens == [2, 3, 4, 1]


def test_max_matches_keeps_most_recent():
    context = [1, 10, 1, 11, 1, 12, 1, 13, 1]
    tree = draft(RetrievalDrafter(l_max=1, max_matches=2, evidence_prior=0), [context])[0]
    assert {path: q for path, q in paths(tree).items() if len(path) == 1} == {(13,): 0.5, (12,): 0.5}


def test_max_depth_caps_continuations():
    tree = draft(RetrievalDrafter(l_max=3, max_depth=2), [CONTEXT])[0]
    assert (tree.tokens, tree.parents) == ([5, 4, 9, 9], [-1, -1, 0, 1])


@pytest.mark.parametrize("context", [[], [7], [1, 2, 3, 4]])
def test_no_repeated_suffix_gives_empty_tree(context):
    assert draft(RetrievalDrafter(), [context])[0] == DraftTree()


@pytest.mark.parametrize("evidence_prior", [0.0, 2.0])
def test_incremental_equals_fresh_and_naive(evidence_prior):
    rng = random.Random(0)
    params = dict(l_max=3, l_min=2, max_matches=3, max_depth=5, evidence_prior=evidence_prior)
    streams = [[rng.randrange(4) for _ in range(80)] for _ in range(2)]
    incremental, length = RetrievalDrafter(**params), 0
    while length < 80:
        length += rng.randint(1, 3)
        contexts = [s[:length] for s in streams]
        for max_nodes, policy in ((100, RetrievalPolicy()), (6, RetrievalPolicy()), (4, ChainPolicy())):
            got = draft(incremental, contexts, max_nodes, policy, ["a", "b"])
            assert got == draft(RetrievalDrafter(**params), contexts, max_nodes, policy, ["a", "b"])
        full = draft(incremental, contexts, ids=["a", "b"])
        for tree, context in zip(full, contexts):
            assert paths(tree) == pytest.approx(naive_paths(context, **params))


def prepared_steps(drafter, seed: int, requests: int, length: int, vocab: int, lengths: range):
    """Prepare ``drafter`` on growing prefixes (``lengths``) of random token
    streams, one per request; yields after each step."""
    rng = random.Random(seed)
    streams = [[rng.randrange(vocab) for _ in range(length)] for _ in range(requests)]
    for n in lengths:
        drafter.prepare([f"r{b}" for b in range(requests)], Contexts.of([s[:n] for s in streams]))
        yield n


class LayerByLayer:
    """The drafter without its whole candidate trees: growth runs the layer loop."""

    growth = Growth.LAYERS

    def __init__(self, drafter):
        self.expand = drafter.expand


@pytest.mark.parametrize("policy", [RetrievalPolicy(), RetrievalPolicy(min_p=0.2), ChainPolicy()], ids=["retrieval", "retrieval-min_p-0.2", "chain"])
def test_choice_from_whole_tree_equals_the_layer_loop(policy):
    drafter = RetrievalDrafter(l_max=3, max_matches=8, max_depth=6, evidence_prior=2.0)
    compared = 0
    for _ in prepared_steps(drafter, seed=1, requests=4, length=120, vocab=5, lengths=range(10, 120, 7)):
        max_nodes = torch.tensor([0, 1, 5, 40])
        whole, _ = grow(drafter, policy, max_nodes, drafter.max_depth)
        layered, _ = grow(LayerByLayer(drafter), policy, max_nodes, drafter.max_depth)
        assert [len(t) for t in whole] == [len(t) for t in layered]
        for a, b in zip(whole, layered):
            assert (a.tokens, a.parents) == (b.tokens, b.parents) and a.q == pytest.approx(b.q)
        compared += sum(len(t) for t in whole)
    assert compared > 100


@pytest.mark.parametrize("floor", [0.05, 0.2, 0.5])
def test_floored_candidate_trees_are_the_whole_trees_above_the_floor(floor):
    """The trie is built only where a node's ``p`` reaches the floor: the same
    nodes, order and ``q`` as the whole tree cut at the floor."""
    drafter = RetrievalDrafter(l_max=2, max_matches=16, max_depth=6, evidence_prior=1.0)
    cut = 0
    for _ in prepared_steps(drafter, seed=2, requests=3, length=150, vocab=6, lengths=range(8, 150, 5)):
        floored, whole = drafter.candidate_trees(floor), drafter.candidate_trees()
        for got, tree in zip(floored, whole):
            p = tree.path_probabilities()
            assert got == tree.subset([i for i, value in enumerate(p) if value >= floor])
            cut += len(tree) - len(got)
    assert cut > 100, cut


@pytest.mark.parametrize(
    "new_context",
    [
        [7, 1, 8, 7],  # the last stored token changed
        [7],  # shorter than the stored context
        [7, 2, 7, 7],  # an earlier token changed
    ],
)
def test_non_extension_resets_the_index(new_context):
    drafter = RetrievalDrafter(l_max=1)
    draft(drafter, [[7, 1, 7]], ids=["a"])
    assert draft(drafter, [new_context], ids=["a"]) == draft(RetrievalDrafter(l_max=1), [new_context])


def test_forget():
    drafter = RetrievalDrafter(l_max=1)
    draft(drafter, [[7, 1, 7]], ids=["a"])
    drafter.forget("a")
    drafter.forget("never seen")
    # Without forget, [7, 2, 7, 7] would be taken as an extension of [7, 1, 7].
    assert draft(drafter, [[7, 2, 7, 7]], ids=["a"]) == draft(RetrievalDrafter(l_max=1), [[7, 2, 7, 7]])
