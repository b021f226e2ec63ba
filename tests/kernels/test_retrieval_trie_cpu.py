"""The native retrieval tries give the Python reference's trees
(``drafters.retrieval_trie.RetrievalDrafter``): the same nodes in the same
order, the same ``q`` to the bit, the same children by handle, over random
contexts that grow by a few tokens a step (mostly copied from earlier in the
context, so that suffixes match at every length), requests in a new order
each step, a reused request id with another context, forgotten requests, the
engine's int32 token array and int64 contexts, and several settings; a CPU
engine's trie matcher takes them where the library builds, the reference
otherwise and wherever the trie matches more than the request's own
context."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from kernels import cpu_library
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_native import NativeRetrievalDrafter
from vllm_adaptive_spec.drafters.retrieval_tensors import TensorRetrievalDrafter, make_retrieval
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter

SETTINGS = [
    {},
    {"l_max": 4, "l_min": 3, "max_matches": 5, "max_depth": 3, "evidence_prior": 0.0},
    {"l_max": 1, "max_matches": 1, "max_depth": 1, "evidence_prior": 9.5},
]


def _grow(rng: random.Random, array: np.ndarray, lengths: list[int], vocab: int) -> None:
    """Each context grows by 1-4 tokens, most of them copied from earlier in it."""
    for b in range(len(lengths)):
        for _ in range(rng.randint(1, 4)):
            n = lengths[b]
            if n >= array.shape[1]:
                break
            copied = rng.random() < 0.8 and n > 1
            array[b, n] = array[b, rng.randrange(n - 1)] if copied else rng.randrange(vocab)
            lengths[b] = n + 1


def _same_trees(reference: RetrievalDrafter, native: NativeRetrievalDrafter, rng: random.Random, batch: int) -> None:
    for floor in (0.0, 0.05, 0.3):
        want, got = reference.candidate_trees(floor), native.candidate_trees(floor)
        assert got == want and [t.q for t in got] == [t.q for t in want], floor
    for b in range(batch):
        handle = -1
        for _ in range(5):  # a random path down the trie, children compared at each node
            kids = reference.children(b, handle)
            assert native.children(b, handle) == kids
            if not kids:
                break
            handle = rng.choice(kids)[2]


@pytest.mark.parametrize("settings", SETTINGS)
@pytest.mark.parametrize("vocab,dtype", [(3, np.int32), (40, np.int32), (50_000, np.int32), (40, np.int64)])
def test_native_tries_match_the_reference(settings, vocab, dtype):
    rng = random.Random(vocab + len(settings))
    batch, width = 6, 600
    reference, native = RetrievalDrafter(**settings), NativeRetrievalDrafter(**settings)
    array = np.zeros((batch + 2, width), dtype=dtype)  # rows beyond the batch: other requests' rows
    lengths = [rng.randint(1, 120) for _ in range(batch)]
    for b, n in enumerate(lengths):
        array[b, :n] = [rng.randrange(vocab) for _ in range(n)]
    ids = [f"request-{b}" for b in range(batch)]
    for step in range(40):
        _grow(rng, array, lengths, vocab)
        if step % 13 == 6:  # a request id reused for another context
            b = rng.randrange(batch)
            array[b, : lengths[b]] = [rng.randrange(vocab) for _ in range(lengths[b])]
        order = rng.sample(range(batch), rng.randint(1, batch))
        contexts = Contexts(array, order, [lengths[b] for b in order])
        for drafter in (reference, native):
            drafter.prepare([ids[b] for b in order], contexts)
        _same_trees(reference, native, rng, len(order))
        if step % 11 == 4:
            for drafter in (reference, native):
                drafter.forget(ids[order[0]], finished=True)
        assert native.requests_held() == reference.requests_held()


def test_a_hand_computed_trie():
    """Context 1 2 3 | 1 2 4 | 1 2 3 | 1 2 with suffixes of at most 2 tokens:
    "1 2" was followed by 3, 4 and 3; the root's children are 3 (q = 2/3)
    and 4 (1/3), and after 4 comes 1."""
    native = NativeRetrievalDrafter(l_max=2, evidence_prior=0.0)
    native.prepare(["a"], Contexts.of([[1, 2, 3, 1, 2, 4, 1, 2, 3, 1, 2]]))
    (tree,) = native.candidate_trees(0.0)
    assert tree.tokens[:2] == [3, 4] and tree.parents[:2] == [-1, -1]
    assert tree.q[:2] == [2 / 3, 1 / 3]
    tokens, q, handles = zip(*native.children(0, -1))
    assert tokens == (3, 4) and native.children(0, handles[1])[0][0] == 1  # after "1 2 4": "1"


def test_bad_input_is_refused_with_a_clear_error():
    native = NativeRetrievalDrafter()
    with pytest.raises(ValueError, match="outside the token array"):
        native.prepare(["a"], Contexts(np.zeros((1, 4), dtype=np.int32), [0], [5]))
    with pytest.raises(ValueError, match="int32 or int64"):
        native.prepare(["a"], Contexts(np.zeros((1, 4), dtype=np.float32), [0], [2]))
    with pytest.raises(ValueError, match="int32 or int64"):  # every other column: not one row's tokens
        native.prepare(["a"], Contexts(np.zeros((1, 8), dtype=np.int32)[:, ::2], [0], [2]))
    with pytest.raises(ValueError, match="no request 0"):
        native.children(0, -1)
    with pytest.raises(ValueError, match="own context only"):
        NativeRetrievalDrafter(datastore="shared")


def test_a_cpu_engine_takes_the_native_tries_where_they_apply(monkeypatch):
    assert type(make_retrieval("cpu")) is NativeRetrievalDrafter, "the native library did not build here"
    assert type(make_retrieval("cpu", datastore="shared")) is RetrievalDrafter
    assert type(make_retrieval("cuda")) is RetrievalDrafter
    assert type(make_retrieval("cpu", matcher="tensors")) is TensorRetrievalDrafter
    cpu_library.native_library.cache_clear()
    try:
        monkeypatch.setenv(cpu_library.SETTING, "torch")
        assert type(make_retrieval("cpu")) is RetrievalDrafter
    finally:
        cpu_library.native_library.cache_clear()


def test_validating_a_config_builds_nothing_native(monkeypatch):
    """A server's front end parses the config; only the engine's worker, on its device, may build
    or load the native library."""
    from vllm_adaptive_spec.config import parse_tree_config
    from vllm_adaptive_spec.drafters import retrieval_tensors

    def refuse():
        raise AssertionError("the config's validation reached the native library")

    monkeypatch.setattr(retrieval_tensors, "native_library", refuse)
    for tree in ({"drafter": "retrieval"}, {"drafter": "retrieval", "matcher": "tensors"}):
        parse_tree_config({"method": "adaptive_tree", "num_speculative_tokens": 16, "tree": tree})
    with pytest.raises(AssertionError, match="reached the native library"):
        make_retrieval("cpu")
