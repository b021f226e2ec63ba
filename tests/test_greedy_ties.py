"""The GPU tests' equality up to the target's own near-ties (tests/greedy_ties.py)."""

from greedy_ties import first_departures, tie_problems

REFERENCE = [[5, 6, 7, 8], [1, 2, 3, 4], [9, 9, 9, 9]]
# Top logprobs of the reference at each position (token id -> logprob).
LOGPROBS = [
    [{"5": -0.1}, {"6": -0.2}, {"7": -0.70, "3": -0.72}, {"8": -0.1}],
    [{"1": -0.1}, {"2": -0.1, "4": -5.0}, {"3": -0.1}, {"4": -0.1}],
    [{"9": -0.1}] * 4,
]


def test_equal_answers_have_no_departures():
    assert first_departures(REFERENCE, REFERENCE, LOGPROBS) == []
    assert tie_problems(REFERENCE, REFERENCE, LOGPROBS, tie=0.1, min_exact=1.0) == []


def test_a_departure_at_a_near_tie_is_allowed():
    candidate = [[5, 6, 3, 1], REFERENCE[1], REFERENCE[2]]
    (request, position, margin), = first_departures(candidate, REFERENCE, LOGPROBS)
    assert (request, position) == (0, 2) and abs(margin - 0.02) < 1e-9
    assert tie_problems(candidate, REFERENCE, LOGPROBS, tie=0.1, min_exact=0.6) == []


def test_a_clear_choice_overturned_fails():
    candidate = [REFERENCE[0], [1, 4, 3, 4], REFERENCE[2]]
    problems = tie_problems(candidate, REFERENCE, LOGPROBS, tie=0.1, min_exact=0.6)
    assert len(problems) == 1 and "request 1: departs at token 1" in problems[0]


def test_a_token_outside_the_returned_logprobs_fails():
    candidate = [REFERENCE[0], REFERENCE[1], [9, 9, 8, 9]]
    assert first_departures(candidate, REFERENCE, LOGPROBS)[0][2] == float("inf")
    assert tie_problems(candidate, REFERENCE, LOGPROBS, tie=0.1, min_exact=0.6)


def test_an_answer_that_stops_early_fails():
    candidate = [REFERENCE[0], REFERENCE[1], [9, 9]]
    assert first_departures(candidate, REFERENCE, LOGPROBS) == [(2, 2, float("inf"))]


def test_too_many_departures_fail_even_at_ties():
    candidate = [[5, 6, 3, 1], REFERENCE[1], REFERENCE[2]]
    problems = tie_problems(candidate, REFERENCE, LOGPROBS, tie=0.1, min_exact=0.9)
    assert problems == ["only 67% of the answers are equal outright (at least 90% expected)"]
