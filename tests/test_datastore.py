"""The retrieval drafter's shared datastore: earlier requests' outputs and a
corpus, bounded, off by default (plain logic, no engine)."""

from __future__ import annotations

import pytest

from test_retrieval import draft, paths
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.datastore import Datastore
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter
from vllm_adaptive_spec.trees.tree import DraftTree

PROMPT, OUTPUT = [1, 2, 3], [10, 11, 12, 13, 14]


def finish(drafter, request_id="a", prompt=PROMPT, output=OUTPUT, finished=True):
    """Serve ``request_id`` for one step at prompt + output, then end it."""
    drafter.prepare([request_id], Contexts.of([prompt + output]), prompt_lens=[len(prompt)])
    drafter.forget(request_id, finished=finished)


def test_a_later_request_drafts_an_earlier_output():
    drafter = RetrievalDrafter(l_max=2, evidence_prior=0, datastore="shared")
    finish(drafter)
    tree = draft(drafter, [[7, 8, 10, 11]], ids=["b"])[0]
    assert tree.tokens == [12, 13, 14] and tree.parents == [-1, 0, 1]


@pytest.mark.parametrize("drafter_args,finished", [({}, True), ({"datastore": "shared"}, False)],
                         ids=["off-by-default", "preempted-not-finished"])
def test_nothing_is_shared_when_off_or_not_finished(drafter_args, finished):
    drafter = RetrievalDrafter(l_max=2, **drafter_args)
    finish(drafter, finished=finished)
    assert draft(drafter, [[7, 8, 10, 11]], ids=["b"])[0] == DraftTree()


def test_the_prompt_is_not_shared():
    drafter = RetrievalDrafter(l_max=2, datastore="shared")
    finish(drafter)
    assert draft(drafter, [[9, 1, 2]], ids=["b"])[0] == DraftTree()  # [1, 2] was followed by 3 in a's prompt


def test_own_occurrences_come_first_and_max_matches_caps_the_rest():
    drafter = RetrievalDrafter(l_max=1, evidence_prior=0, max_matches=2, max_depth=1, datastore="shared")
    for request_id, follower in (("a", 20), ("b", 21), ("c", 22)):
        finish(drafter, request_id, prompt=[0], output=[5, follower])
    own = draft(drafter, [[5, 23, 5]], ids=["d"])[0]
    # Own [5 -> 23] first, then the most recent shared output [5 -> 22]; 20 and 21 are past the cap.
    assert paths(own) == {(23,): 0.5, (22,): 0.5}


def test_continuations_stop_at_a_document_end_and_never_span_two():
    store = Datastore(l_max=2, max_tokens=100)
    store.add([1, 2, 3])
    store.add([4, 5])
    (end,) = store.match_ends((2,))
    assert store.continuation(end + 1, 10) == [3]
    assert store.match_ends((3, 4)) == []


def test_the_datastore_keeps_at_most_its_bound_oldest_dropped_first():
    store = Datastore(l_max=2, max_tokens=10)
    for first in range(0, 60, 4):
        store.add([100 + first, 101 + first, 102 + first, 103 + first])
        assert store.num_tokens <= 10
        assert len(store.tokens) <= 2 * (10 + 4)  # dropped entries are rebuilt away
    assert store.match_ends((100, 101)) == []  # the first document is gone
    (end,) = store.match_ends((156, 157))  # the last one is kept
    assert store.continuation(end + 1, 5) == [158, 159]
    assert store.num_tokens == 8  # two documents of 4; a third would exceed 10


def test_a_document_longer_than_the_bound_keeps_its_tail():
    store = Datastore(l_max=1, max_tokens=3)
    store.add([1, 2, 3, 4, 5])
    assert store.num_tokens == 3 and store.match_ends((2,)) == [] and store.match_ends((3,)) != []


def test_clear_shared_empties_it():
    drafter = RetrievalDrafter(l_max=2, datastore="shared")
    finish(drafter)
    assert drafter.clear_shared() == len(OUTPUT)
    assert draft(drafter, [[7, 8, 10, 11]], ids=["b"])[0] == DraftTree()


def test_corpus_paragraphs_are_drafted_from(tmp_path):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("40 41 42 43\n\n50 51 52\n", encoding="utf-8")
    drafter = RetrievalDrafter(l_max=2, evidence_prior=0, corpus=str(corpus))
    drafter.load_corpus(lambda text: [int(word) for word in text.split()])
    assert draft(drafter, [[9, 40, 41]], ids=["b"])[0].tokens == [42, 43]
    assert draft(drafter, [[9, 43]], ids=["c"])[0] == DraftTree()  # 43 ends its paragraph
