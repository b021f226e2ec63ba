"""Which requests got trees, by the kind of sampling they asked for
(structured and penalised requests are speculated too, and the serving
benchmark reports the share of them that received trees).

A request counts once it has finished (or been aborted) after at least two
output tokens (a request of one token has no decoding step to verify a tree
in); it *drafted* if at least one of its steps verified a tree of its
drafter, and was *forced* if one verified tokens its grammar forced
(``tree_scheduler``'s ``grammar_forcing``, counted apart: not the drafter's). Decision:
counted in the worker, where trees are verified, by the request's sampling
parameters: the client cannot see drafts, and vLLM's counters are not per
request.
"""

from __future__ import annotations

from vllm_adaptive_spec.adapter.request_options import speculation_allowed

KINDS = ("opted_out", "structured", "penalised", "processors", "plain")


def request_kind(params) -> str:
    """``opted_out`` (speculation switched off for the request,
    ``request_options``), ``structured`` (a grammar), ``penalised``
    (presence, frequency or repetition penalty), ``processors`` (logit bias,
    ``min_p``, bad words, ``min_tokens`` or allowed tokens) or ``plain``: the
    first that applies."""
    if params is None:
        return "plain"
    if not speculation_allowed(params):
        return "opted_out"
    if params.structured_outputs is not None:
        return "structured"
    if params.presence_penalty or params.frequency_penalty or params.repetition_penalty != 1.0:
        return "penalised"
    if params.logit_bias or params.min_p or params.bad_words or params.min_tokens or params.allowed_token_ids:
        return "processors"
    return "plain"


class DraftedShare:
    """Per kind, the requests counted and those of them that drafted, or had forced tokens."""

    def __init__(self) -> None:
        self._drafted: set[str] = set()  # requests in flight that have had a drafter's tree verified
        self._forced: set[str] = set()  # and grammar-forced tokens
        self._counts = {kind: {"requests": 0, "drafted": 0, "forced": 0} for kind in KINDS}

    def verified(self, drafted: list[str], forced: list[str] = ()) -> None:
        self._drafted.update(drafted)
        self._forced.update(forced)

    def finished(self, request_id: str, params, output_tokens: int) -> None:
        drafted, forced = request_id in self._drafted, request_id in self._forced
        self._drafted.discard(request_id)
        self._forced.discard(request_id)
        if output_tokens >= 2:
            counts = self._counts[request_kind(params)]
            counts["requests"] += 1
            counts["drafted"] += drafted
            counts["forced"] += forced

    def requests_held(self) -> int:
        return len(self._drafted | self._forced)

    def as_dict(self) -> dict[str, dict[str, int]]:
        return {kind: dict(counts) for kind, counts in self._counts.items()}
