"""Greedy equality where the target's own arithmetic allows it.

On a GPU vLLM's kernels are not batch-invariant: the same request gives
logits that differ in their last bits with the step's shape (a verify step
of ``1 + n`` rows against a decode step of one, 32 requests against one),
so the target alone can pick either of two tokens whose logprobs are nearly
equal, and vLLM's own speculative methods are not bit-equal to no
speculation there either. What speculation must keep is every choice the
target makes clearly: each greedy answer equals the reference's, or first
departs from it where the reference's logprobs of the two tokens lie within
``tie`` of each other. After that point the contexts differ, so nothing
further is compared. On the CPU the suite asks for exact equality instead.
"""

from __future__ import annotations

import math


def first_departures(candidate: list[list[int]], reference: list[list[int]],
                     reference_logprobs: list[list[dict[str, float]]]) -> list[tuple[int, int, float]]:
    """``(request, position, margin)`` for each answer that differs from the
    reference: the first position where it does, and the reference's logprob
    of its own token there minus that of the candidate's (infinite when the
    candidate's token is not among the reference's returned logprobs, or one
    answer stops where the other goes on)."""
    departures = []
    for request, (mine, theirs) in enumerate(zip(candidate, reference)):
        if mine == theirs:
            continue
        position = next((p for p, (a, b) in enumerate(zip(mine, theirs)) if a != b), min(len(mine), len(theirs)))
        margin = math.inf
        if position < min(len(mine), len(theirs)):
            top = reference_logprobs[request][position]
            if str(mine[position]) in top:
                margin = top[str(theirs[position])] - top[str(mine[position])]
        departures.append((request, position, margin))
    return departures


def tie_problems(candidate: list[list[int]], reference: list[list[int]],
                 reference_logprobs: list[list[dict[str, float]]], tie: float, min_exact: float) -> list[str]:
    """What breaks greedy equality up to ties: a departure at a margin above
    ``tie``, or fewer than ``min_exact`` of the answers equal outright."""
    departures = first_departures(candidate, reference, reference_logprobs)
    problems = [f"request {r}: departs at token {p} where the target prefers its own token by {m:.3g} (> {tie})"
                for r, p, m in departures if m > tie]
    exact = 1 - len(departures) / max(len(reference), 1)
    if exact < min_exact:
        problems.append(f"only {exact:.0%} of the answers are equal outright (at least {min_exact:.0%} expected)")
    return problems
