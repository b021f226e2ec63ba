"""Seeded random combinations of the API's sampling options, sent to a server
without speculation and to one with ``adaptive_tree`` (the parity test's two
servers, ``conftest.parity_servers``), 8 at a time to each in turn:
every request gets the same status from both, none a 5xx (a refusal the same
message), a greedy one the same answer (text, finish reason, token counts,
logprobs within tolerance; a sampled one only as many choices: its trees draw
in another order), and both servers are still healthy afterwards.

Where ``test_serve_parity.py`` sends each option alone, this draws them
together: temperature (0 or sampled), ``n``, ``seed``, ``top_p``, ``top_k``,
``min_p``, the three penalties, ``logit_bias``, ``bad_words``, ``min_tokens``,
``stop``, ``ignore_eos``, logprobs, and a grammar (``choice``, ``regex``,
``json``, ``response_format`` ``json_object`` / ``json_schema``), on
``/v1/chat/completions`` and ``/v1/completions``. A grammar, ``ignore_eos``
and ``min_tokens`` each come in about a third to two fifths of the requests,
and a grammar's request is drawn with ``ignore_eos``, ``min_tokens`` (past
what a ``choice`` takes) or both more often than not: a grammar that has
ended while its request may not stop yet is where the scheduler's grammar
forcing and the tree rows' stop-token masks meet (two faults found there:
xgrammar aborting the engine on ``ignore_eos`` past a regex's end, and a
500 for a ``choice`` past its end under ``min_tokens`` where the retrieval
drafter drafts on, its strings being in the prompt). ``max_tokens`` is
mostly short (8-32) for speed.

On failure, the summary gives each differing request's options and both
statuses (or the first differences); where the tree server's engine died,
the requests in flight then (one of them killed it) and its log's errors.
``FUZZ_SEED`` (0) and ``FUZZ_REQUESTS`` (200) draw another run.
"""

from __future__ import annotations

import json
import os
import random
import re
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from parity_cases import A, CODE, EXTRACT, FACTS, FENCE, FOX, HERE, IM_END, NEWLINE, PROMPT, REPEAT, SCHEMA, THE, Case
from test_serve_parity import answer, differences


pytestmark = pytest.mark.engine

SEED = int(os.environ.get("FUZZ_SEED", "0"))
REQUESTS = int(os.environ.get("FUZZ_REQUESTS", "200"))
CONCURRENCY = 8

GREETING = [{"role": "user", "content": "Say hello and name a colour."}]
CHAT_PROMPTS = [CODE, FACTS, EXTRACT, GREETING, REPEAT]
COMPLETION_PROMPTS = [PROMPT, "The capital of France is", "Alice is 31 and lives in Paris. Bob is",
                      REPEAT[0]["content"]]
# Grammars by kind, drawn by GRAMMAR_WEIGHTS: more often the ones that end within a few tokens
# (where a request that may not stop yet meets a grammar that allows nothing but a stop).
GRAMMARS = {
    # FOX's strings are in REPEAT: the retrieval drafter drafts on past their end, into tree rows
    # where the grammar allows nothing but a stop token (which min_tokens masks).
    "choice": [{"structured_outputs": {"choice": ["Paris", "London"]}},
               {"structured_outputs": {"choice": ["yes", "no", "maybe"]}}, {"structured_outputs": FOX},
               {"structured_outputs": FOX}],
    "regex": [{"structured_outputs": {"regex": "[a-z]{3,6} [0-9]{2}"}},
              {"structured_outputs": {"regex": "[A-Z][a-z]+ is [0-9]+"}}],
    "json": [{"structured_outputs": {"json": SCHEMA}}],
    "json_object": [{"response_format": {"type": "json_object"}}],
    "json_schema": [{"response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA}}}],
}
GRAMMAR_WEIGHTS = {"choice": 4, "regex": 3, "json": 1, "json_object": 1, "json_schema": 1}
BIASED = [HERE, THE, A, FENCE, NEWLINE, IM_END]
BAD_WORDS = [["def"], [" squares", "Moon"], [" the"], ["Paris"]]
STOPS = [["\n"], ["the", "."], ["return"], ["\n\n", "}"]]
MAX_TOKENS = [8, 8, 12, 12, 16, 16, 24, 32]  # mostly short: the run's time is its decode steps


def grammar_kind(body: dict) -> str | None:
    if "response_format" in body:
        return body["response_format"]["type"]
    return next(iter(body.get("structured_outputs", {})), None)


def draw(rng: random.Random, index: int) -> Case:
    """One request: each option on with its own probability, values drawn."""
    endpoint = "chat" if rng.random() < 0.8 else "completions"
    max_tokens = rng.choice(MAX_TOKENS)
    temperature = 0 if rng.random() < 0.5 else rng.choice([0.5, 0.8, 1.0, 1.5])
    body: dict = {"max_tokens": max_tokens, "temperature": temperature}
    if endpoint == "chat":
        body["messages"] = rng.choice(CHAT_PROMPTS)
    else:
        body["prompt"] = rng.choice(COMPLETION_PROMPTS)
    if rng.random() < 0.35:
        kinds = [k for k in GRAMMAR_WEIGHTS if endpoint == "chat" or not k.startswith("json_")]
        kind = rng.choices(kinds, [GRAMMAR_WEIGHTS[k] for k in kinds])[0]
        body |= rng.choice(GRAMMARS[kind])
        if body.get("structured_outputs") == FOX and rng.random() < 0.9:
            body |= {"messages": REPEAT} if endpoint == "chat" else {"prompt": REPEAT[0]["content"]}
    if rng.random() < 0.2:
        body["n"] = rng.choice([2, 3])
    if rng.random() < 0.3:
        body["seed"] = rng.randrange(1000)
    if rng.random() < 0.2:
        body["top_p"] = rng.choice([0.5, 0.9])
    if rng.random() < 0.2:
        body["top_k"] = rng.choice([1, 5, 20])
    if rng.random() < 0.2:
        body["min_p"] = rng.choice([0.05, 0.2, 0.5])
    if rng.random() < 0.15:
        body["presence_penalty"] = rng.choice([-1.0, 0.5, 1.5])
    if rng.random() < 0.15:
        body["frequency_penalty"] = rng.choice([-0.5, 0.5, 1.0])
    if rng.random() < 0.15:
        body["repetition_penalty"] = rng.choice([0.8, 1.2, 1.5])
    if rng.random() < 0.15:
        body["logit_bias"] = {str(t): rng.choice([-100, -5, 3, 10]) for t in rng.sample(BIASED, rng.randint(1, 3))}
    if rng.random() < 0.1:
        body["bad_words"] = rng.choice(BAD_WORDS)
    # With a grammar: ignore_eos, min_tokens (mostly past what a choice takes), both, or neither.
    with_grammar = rng.choice(["ignore_eos", "min_tokens", "min_tokens", "both", None]) if grammar_kind(body) else None
    if with_grammar in ("min_tokens", "both") or (not grammar_kind(body) and rng.random() < 0.3):
        # Now and then past max_tokens: a refusal, the same on both servers.
        low = max_tokens // 2 if grammar_kind(body) else 1
        body["min_tokens"] = rng.randint(low, max_tokens) if rng.random() < 0.9 else max_tokens + 4
    if rng.random() < 0.15:
        body["stop"] = rng.choice(STOPS)
    if with_grammar in ("ignore_eos", "both") or (not grammar_kind(body) and rng.random() < 0.3):
        body["ignore_eos"] = True
    if rng.random() < 0.2:
        if endpoint == "chat":
            body |= {"logprobs": True, "top_logprobs": rng.choice([0, 1, 3, 5])}
        else:
            body["logprobs"] = rng.choice([0, 1, 3])
    return Case(f"{index}", endpoint, body, same_text=body["temperature"] == 0)


_RNG = random.Random(SEED)
CASES = [draw(_RNG, index) for index in range(REQUESTS)]


@pytest.fixture(scope="module")
def fuzz(parity_servers, demo_model):
    """Every case's answer from each server ({"none": [...], "tree": [...]}),
    each server's /health status after the run, and the tree server's log."""
    servers, out = parity_servers
    result = {}
    for label, server in servers.items():
        with ThreadPoolExecutor(CONCURRENCY) as pool:
            result[label] = list(pool.map(lambda case: ask(server.base, demo_model, case), CASES))
    result["health"] = {label: health(server.base) for label, server in servers.items()}
    (out / "fuzz_answers.json").write_text(json.dumps(result, indent=1))
    result["tree_log"] = (out / "tree.log").read_text(errors="replace")
    return result


def ask(base: str, model: str, case: Case) -> dict:
    """``answer``, or a status 599 where the server did not answer at all."""
    try:
        return answer(base, model, case)
    except Exception as error:  # noqa: BLE001 - a dead server fails in any way
        return {"status": 599, "error": repr(error)}


def health(base: str) -> int | str:
    try:
        with urllib.request.urlopen(base + "/health", timeout=30) as response:
            return response.status
    except Exception as error:  # noqa: BLE001 - a dead server answers with anything
        return getattr(error, "code", None) or repr(error)


def describe(case: Case) -> str:
    """A request in one line: its endpoint and options (prompts abbreviated)."""
    body = {k: v for k, v in case.body.items() if k not in ("messages", "prompt")}
    prompt = case.body.get("prompt") or case.body["messages"][0]["content"]
    return f"#{case.name} {case.endpoint} {json.dumps(body, separators=(',', ':'))} prompt={str(prompt)[:20]!r}"


def problem(case: Case, plain: dict, tree: dict) -> str | None:
    """What is wrong with one request's pair of answers, or None."""
    if plain["status"] != tree["status"] or plain["status"] >= 500:
        detail = tree.get("error") if tree["status"] != 200 else plain.get("error")
        return f"status none {plain['status']} / tree {tree['status']}: {str(detail)[:160]}"
    if plain["status"] != 200:
        return None if tree["error"] == plain["error"] else f"error {plain['error']!r} != {tree['error']!r}"
    if case.same_text:
        diffs = differences(plain["body"], tree["body"])
        return f"greedy answers differ: {'; '.join(diffs[:3])[:300]}" if diffs else None
    want = case.body.get("n", 1)
    counts = [len(result["body"]["choices"]) for result in (plain, tree)]
    return None if counts == [want, want] else f"choices none {counts[0]} / tree {counts[1]} (n {want})"


def engine_errors(log: str) -> str:
    """The tree server log's error lines (the first few): where its engine died."""
    lines = [line for line in log.splitlines() if re.search(r" ERROR .*(Error|Check failed)", line)]
    return "\n".join(dict.fromkeys(line.split("] ", 1)[-1][:300] for line in lines[:20]))


def engine_died(result: dict) -> bool:
    """An answer that only says the engine is gone (in flight when it died: a
    500 naming the dead engine; after: no server to answer)."""
    return result["status"] == 599 or (result["status"] == 500 and "EngineCore" in str(result.get("error")))


def test_every_combination_answered_as_without_speculation(fuzz):
    problems = [(case, plain, tree, text) for case, plain, tree in zip(CASES, fuzz["none"], fuzz["tree"])
                if (text := problem(case, plain, tree))]
    statuses = sorted({(p["status"], t["status"]) for p, t in zip(fuzz["none"], fuzz["tree"])})
    summary = [f"{len(problems)} of {len(CASES)} requests (FUZZ_SEED={SEED}) differ; (none, tree) statuses {statuses}"]
    alive = [(case, text) for case, plain, tree, text in problems if not engine_died(tree)]
    summary += [f"{describe(case)}\n    {text}" for case, text in alive[:15]]
    in_flight = [(case, text) for case, plain, tree, text in problems if engine_died(tree) and tree["status"] == 500]
    if len(alive) < len(problems):
        summary.append(f"the tree server's engine died: {len(problems) - len(alive)} requests failed with it; "
                       f"these {len(in_flight)} were in flight (one of them killed it):")
        summary += [f"{describe(case)}\n    {text}" for case, text in in_flight[:CONCURRENCY]]
        summary.append("tree server log:\n" + engine_errors(fuzz["tree_log"]))
    assert not problems, "\n".join(summary)


def test_servers_still_healthy(fuzz):
    assert fuzz["health"] == {"none": 200, "tree": 200}, (fuzz["health"], engine_errors(fuzz["tree_log"]))


def test_the_draws_meet_the_combinations_they_aim_at():
    """The pairs that need a grammar to stop early, with a request that may not
    stop: drawn often enough per run that a fault there shows up."""
    bodies = [case.body for case in CASES]
    assert sum(bool(grammar_kind(b) and b.get("ignore_eos")) for b in bodies) >= 10
    assert sum(grammar_kind(b) == "regex" and bool(b.get("ignore_eos")) for b in bodies) >= 3
    choice_min_tokens = [b for b in bodies if grammar_kind(b) == "choice" and b.get("min_tokens", 0) > 4]
    assert len(choice_min_tokens) >= 6
    assert sum(b["temperature"] > 0 and not b.get("ignore_eos") for b in choice_min_tokens) >= 2
    assert sum(b.get("structured_outputs") == FOX and REPEAT[0]["content"] in json.dumps(b)
               and not b.get("ignore_eos") for b in choice_min_tokens) >= 2
    assert sum(b["temperature"] == 0 for b in bodies) >= len(bodies) // 3
