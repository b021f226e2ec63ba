"""The retrieval drafter's tensor matcher against its
trie: the same candidate trees, floats and ties included, on random token
streams (small vocabularies, so matches and count ties are many) and on the
project's prompts; the same layer-by-layer growth; traced whole by
``torch.compile(fullgraph=True)``; the same operations at every batch size
and context length."""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
from dispatched_ops import dispatched, reads

from vllm_adaptive_spec.config import TreeConfig
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_trie import EVIDENCE_EXPONENT, RetrievalDrafter, resolve_matcher
from vllm_adaptive_spec.drafters.retrieval_tensors import (
    TensorRetrievalDrafter,
    candidate_trees,
    continuations,
    evidence_table,
    longest_matches,
)
from vllm_adaptive_spec.policies import ChainPolicy, RetrievalPolicy
from vllm_adaptive_spec.step.growth import grow
from vllm_adaptive_spec.trees.tree import DraftTree

PROMPTS = Path(__file__).parent.parent / "vllm_adaptive_spec" / "data" / "prompts.jsonl"


def both(params: dict, contexts: list[list[int]]) -> tuple[RetrievalDrafter, TensorRetrievalDrafter]:
    ids = [f"r{b}" for b in range(len(contexts))]
    trie, tensors = RetrievalDrafter(**params), TensorRetrievalDrafter("cpu", **params)
    for drafter in (trie, tensors):
        drafter.prepare(ids, Contexts.of(contexts))
    return trie, tensors


def random_contexts(rng: random.Random, batch: int, vocab: int) -> list[list[int]]:
    return [[rng.randrange(vocab) for _ in range(rng.randint(1, 80))] for _ in range(batch)]


@pytest.mark.parametrize("seed", range(40))
def test_the_same_trees_as_the_trie_on_random_streams(seed):
    rng = random.Random(seed)
    l_max = rng.randint(1, 8)
    params = {"l_max": l_max, "l_min": 1 if seed % 4 else min(l_max, 2), "max_matches": rng.choice([1, 4, 32]),
              "max_depth": rng.choice([1, 5, 16]), "evidence_prior": rng.choice([0.0, 2.0, 4.0])}
    trie, tensors = both(params, random_contexts(rng, 6, rng.choice([2, 4, 9])))
    for floor in (0.0, 0.05, 0.3):
        assert tensors.candidate_trees(floor) == trie.candidate_trees(floor)
    assert sum(len(t) for t in trie.candidate_trees()) > 0


def test_the_same_trees_as_the_trie_on_the_projects_prompts(demo_tokenizer):
    """Each prompt's tokens (as the chat template lays them out) cut at every
    16th position, as the steps of a request would see its context grow."""
    prompts = [json.loads(line)["messages"] for line in PROMPTS.read_text(encoding="utf-8").splitlines()]
    texts = [demo_tokenizer.apply_chat_template(messages, tokenize=False) for messages in prompts]
    streams = [demo_tokenizer.encode(text, add_special_tokens=False) for text in texts]
    contexts = [stream[:cut] for stream in streams for cut in range(16, len(stream) + 1, 16)]
    trie, tensors = both({}, contexts)
    assert tensors.candidate_trees(0.05) == trie.candidate_trees(0.05)
    assert tensors.candidate_trees(0.0) == trie.candidate_trees(0.0)
    assert sum(1 for t in trie.candidate_trees(0.05) if len(t)) > len(contexts) // 4


def test_the_policys_choice_on_the_device_is_its_choice_per_tree():
    """``grow`` hands the tensor matcher's whole trees to the retrieval
    policy's ``choose_tensors`` (the best nodes of each, on the device): the
    trees its ``choose`` picks one by one from the trie's, ties included,
    node limits of 0 and limits that cut included."""
    cut = 0
    for seed in range(16):
        rng = random.Random(seed)
        params = {"l_max": rng.randint(1, 8), "max_matches": rng.choice([4, 32]), "max_depth": rng.choice([5, 16]),
                  "evidence_prior": rng.choice([0.0, 4.0])}
        trie, tensors = both(params, random_contexts(rng, 8, rng.choice([2, 4, 9])))
        policy, floor = RetrievalPolicy(min_p=rng.choice([0.0, 0.05, 0.3])), rng.choice([0.0, 0.1])
        max_nodes = torch.tensor([0] + [rng.randint(1, 6) for _ in range(7)])
        whole = trie.candidate_trees(max(policy.min_p, floor))
        want = [policy.choose(tree, n) if n > 0 else DraftTree() for tree, n in zip(whole, max_nodes.tolist())]
        assert grow(tensors, policy, max_nodes, 16, floor)[0] == want
        cut += sum(len(tree) > n > 0 for tree, n in zip(whole, max_nodes.tolist()))
    assert cut > 16


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_same_chosen_trees_on_cuda():
    """On CUDA tensors (``scripts/gpu_checks.sh``): the trees the trie's
    policy chooses, ties included, where the device's own reductions and
    products could differ from the host's."""
    for seed in range(8):
        rng = random.Random(seed)
        contexts = random_contexts(rng, 16, rng.choice([2, 4, 9]))
        ids = [f"r{b}" for b in range(16)]
        trie, tensors = RetrievalDrafter(), TensorRetrievalDrafter("cuda")
        for drafter in (trie, tensors):
            drafter.prepare(ids, Contexts.of(contexts))
        max_nodes = torch.full((16,), 16)
        assert grow(tensors, RetrievalPolicy(), max_nodes, 16)[0] == grow(trie, RetrievalPolicy(), max_nodes, 16)[0]


def test_the_layer_loop_grows_the_same_trees():
    """The chain policy grows layer by layer through ``expand`` (and so does
    the hybrid): the tensor matcher answers from its whole trees on the
    device, ``max_matches`` children wide, where the trie is as wide as its
    widest node; a node beyond the trees has no children."""
    rng = random.Random(7)
    trie, tensors = both({"max_depth": 6, "max_matches": 5}, random_contexts(rng, 8, 3))
    max_nodes = torch.full((8,), 6)
    assert grow(tensors, ChainPolicy(), max_nodes, 6)[0] == grow(trie, ChainPolicy(), max_nodes, 6)[0]
    roots = torch.full((8, 2), -1)
    live = torch.tensor([[True, False]] * 8)
    got, want = tensors.expand(roots, live), trie.expand(roots, live)
    width = want.q.shape[-1]
    assert got.q.shape[-1] == 5 and torch.equal(got.tokens[..., :width], want.tokens)
    assert torch.equal(got.q[..., :width], want.q) and not got.q[..., width:].any()
    assert not tensors.expand(torch.full((8, 1), 10_000), torch.ones(8, 1, dtype=torch.bool)).q.any()


def device_trees(tokens, lengths, kappa, floor: float):
    """The whole trees and, as the retrieval policy chooses them, each one's best 16 nodes."""
    matches = longest_matches(tokens, lengths, 1, 8, 32)
    cont = continuations(tokens, lengths, matches.ends, 16)
    whole = candidate_trees(cont, matches.length, kappa, floor)
    return whole, whole.best(torch.full_like(lengths, 16), 16)


def padded_batch(seed: int, batch: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 5, (batch, width), generator=gen), torch.randint(1, width + 1, (batch,), generator=gen)


def kappa_table() -> torch.Tensor:
    return torch.tensor(evidence_table(4.0, 8, 16, EVIDENCE_EXPONENT), dtype=torch.float64)


def test_the_device_part_compiles_whole_and_equals_eager():
    torch._dynamo.reset()
    tokens, lengths = padded_batch(0, 4, 40)
    compiled = torch.compile(device_trees, fullgraph=True, dynamic=False, backend="aot_eager")
    eager, traced = device_trees(tokens, lengths, kappa_table(), 0.05), compiled(tokens, lengths, kappa_table(), 0.05)
    for got_trees, want_trees in zip(traced, eager):
        for got, want in zip(got_trees, want_trees):
            assert torch.equal(got, want)
    assert eager[1].num_nodes.sum() > 0


def test_the_same_operations_at_every_batch_and_context():
    """No loop over requests, positions or nodes: the operations dispatched
    are the same at batch 8 and 64 and for contexts of 64 and 512 tokens,
    and none reads a value back."""
    counts = []
    for batch, width in ((8, 64), (64, 64), (8, 512), (64, 512)):
        tokens, lengths = padded_batch(batch + width, batch, width)
        counts.append(dispatched(device_trees, tokens, lengths, kappa_table(), 0.05))
    assert all(count == counts[0] for count in counts)
    assert not reads(counts[0])


def test_auto_is_the_trie_and_the_tensors_refuse_what_they_cannot_match():
    assert resolve_matcher("auto") == "trie"
    assert resolve_matcher("tensors") == "tensors"
    with pytest.raises(ValueError, match="datastore 'shared' and corpus need matcher 'trie'"):
        RetrievalDrafter(matcher="tensors", datastore="shared")
    config = TreeConfig("retrieval", "retrieval", 16, {"matcher": "tensors"}, {})
    assert isinstance(config.make_drafter("cpu"), TensorRetrievalDrafter)
    assert isinstance(TreeConfig("retrieval", "retrieval", 16).make_drafter("cpu"), RetrievalDrafter)
    assert type(TreeConfig("retrieval", "retrieval", 16).make_drafter("cuda")) is RetrievalDrafter
    np.testing.assert_array_equal(np.diff(kappa_table().numpy()[1:]) < 0, True)  # kappa falls with evidence
