"""The count of requests that received trees, by kind of sampling
(``adapter/drafted_share``; plain logic, vLLM's own sampling parameters)."""

from __future__ import annotations

from vllm import SamplingParams
from vllm.sampling_params import StructuredOutputsParams

from vllm_adaptive_spec.adapter.drafted_share import DraftedShare, request_kind


def test_each_request_is_counted_once_under_the_first_kind_that_applies():
    grammar = StructuredOutputsParams(regex="[a-z]+")
    assert request_kind(SamplingParams(structured_outputs=grammar, repetition_penalty=1.1)) == "structured"
    assert request_kind(SamplingParams(frequency_penalty=0.3, min_p=0.1)) == "penalised"
    assert request_kind(SamplingParams(repetition_penalty=1.1)) == "penalised"
    for options in ({"logit_bias": {5: 2.0}}, {"min_p": 0.1}, {"bad_words": ["no"]}, {"min_tokens": 3},
                    {"allowed_token_ids": [1, 2]}):
        assert request_kind(SamplingParams(**options)) == "processors", options
    assert request_kind(SamplingParams(temperature=0.7, top_k=5)) == request_kind(None) == "plain"
    off = SamplingParams(structured_outputs=grammar, extra_args={"speculation": "off"})
    assert request_kind(off) == "opted_out"
    assert request_kind(SamplingParams(extra_args={"speculation": "on"})) == "plain"


def test_drafted_means_a_tree_verified_and_short_requests_are_left_out():
    share = DraftedShare()
    share.verified(["a", "b"])
    share.verified(["a"], ["d"])
    share.finished("a", SamplingParams(repetition_penalty=1.2), 30)
    share.finished("b", SamplingParams(), 1)  # one token: no step could verify a tree
    share.finished("c", SamplingParams(), 9)
    assert share.requests_held() == 1
    share.finished("d", SamplingParams(structured_outputs=StructuredOutputsParams(json={"type": "object"})), 9)
    assert share.as_dict()["penalised"] == {"requests": 1, "drafted": 1, "forced": 0}
    assert share.as_dict()["plain"] == {"requests": 1, "drafted": 0, "forced": 0}
    # Grammar-forced tokens are not the drafter's tree: counted apart.
    assert share.as_dict()["structured"] == {"requests": 1, "drafted": 0, "forced": 1}
    assert share.requests_held() == 0
