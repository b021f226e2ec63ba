"""A server with ``adaptive_tree`` answers every request the same server
without speculation answers, the same way: the same status for every
sampling option of ``/v1/chat/completions`` and ``/v1/completions``
(``parity_cases.py``), the same error message for every malformed one, and
the same answer (text, finish reason, token counts, logprobs) for greedy and
seeded requests that vLLM's own sampler serves. Both servers are up at once
(``conftest.parity_servers``, shared with the fuzz test)."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import pytest

from benchmarks.serving.servers import counters
from parity_cases import CASES, Case


pytestmark = pytest.mark.engine

VOLATILE = {"id", "created", "system_fingerprint"}  # differ between any two answers
LOGPROB_TOLERANCE = 1e-3  # the same logits row computed in differently shaped batches


@pytest.fixture(scope="module")
def answers(parity_servers, demo_model):
    """Every case's normalised answer from each server: {"none": {...}, "tree": {...}},
    and the tree server's spec-decode counters for these cases alone (the servers are
    shared with the fuzz test, which may have run first)."""
    servers, out = parity_servers
    before = counters(servers["tree"].get("/metrics"))
    result = {}
    together = [case for case in CASES if not case.alone]
    for label, server in servers.items():
        with ThreadPoolExecutor(8) as pool:
            result[label] = dict(zip((c.name for c in together),
                                     pool.map(lambda case: answer(server.base, demo_model, case), together)))
        result[label] |= {case.name: answer(server.base, demo_model, case) for case in CASES if case.alone}
    after = counters(servers["tree"].get("/metrics"))
    result["counters"] = {key: value - before.get(key, 0.0) for key, value in after.items()}
    (out / "answers.json").write_text(json.dumps(result, indent=1))
    return result


def answer(base: str, model: str, case: Case) -> dict:
    """The status and the answer without its volatile fields (a stream merged
    into one answer per choice), or the error message; ``spec``: vLLM's
    per-request speculative-decoding report, where the server gives one
    (the tree server, for a request of one choice; not compared)."""
    path = "/v1/chat/completions" if case.endpoint == "chat" else "/v1/completions"
    request = urllib.request.Request(base + path, json.dumps({"model": model, **case.body}).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=300) as response:
            if case.stream:
                return {"status": response.status, "body": merge_stream(response)}
            body = json.load(response)
            report = (body.pop("metrics", None) or {}).get("speculative_decoding")
            return {"status": response.status, "body": strip(body), "spec": report}
    except urllib.error.HTTPError as error:
        return {"status": error.code, "error": json.loads(error.read() or b"{}").get("error", {}).get("message")}


def strip(value):
    if isinstance(value, dict):
        return {k: strip(v) for k, v in value.items() if k not in VOLATILE}
    if isinstance(value, list):
        return [strip(v) for v in value]
    return value


def merge_stream(response) -> dict:
    """A streamed answer as {choice index: [text, finish reason]} and its usage
    (chunk boundaries differ: a speculative step emits several tokens)."""
    choices, usage = {}, None
    for line in response:
        line = line.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        chunk = json.loads(line[len("data: "):])
        usage = chunk.get("usage") or usage
        for choice in chunk.get("choices", []):
            text = choice.get("text", choice.get("delta", {}).get("content")) or ""
            merged = choices.setdefault(choice["index"], ["", None])
            merged[0] += text
            merged[1] = choice.get("finish_reason") or merged[1]
    return {"choices": choices, "usage": usage}


def differences(plain, tree, where: str = "") -> list[str]:
    """Where two answers differ (floats within ``LOGPROB_TOLERANCE``)."""
    if isinstance(plain, dict) and isinstance(tree, dict):
        if plain.keys() != tree.keys():
            return [f"{where}: keys {sorted(plain)} != {sorted(tree)}"]
        return [d for k in plain for d in differences(plain[k], tree[k], f"{where}.{k}")]
    if isinstance(plain, list) and isinstance(tree, list):
        if len(plain) != len(tree):
            return [f"{where}: {len(plain)} != {len(tree)} items"]
        return [d for k, (p, t) in enumerate(zip(plain, tree)) for d in differences(p, t, f"{where}[{k}]")]
    if isinstance(plain, float) and isinstance(tree, float):
        return [] if math.isclose(plain, tree, abs_tol=LOGPROB_TOLERANCE) else [f"{where}: {plain} != {tree}"]
    return [] if plain == tree else [f"{where}: {plain!r} != {tree!r}"]


def choice_count(result: dict) -> int:
    return len(result.get("body", {}).get("choices", ()))


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_tree_server_answers_as_the_server_without_speculation(answers, case):
    plain, tree = answers["none"][case.name], answers["tree"][case.name]
    if case.plugin_refusal:
        assert plain["status"] == 200 and tree["status"] == 400, (plain, tree)
        assert re.search(case.plugin_refusal, tree["error"]), tree
        return
    assert tree["status"] == plain["status"], (plain, tree)
    if plain["status"] != 200:
        assert 400 <= plain["status"] < 500 and plain["error"], plain
        assert tree["error"] == plain["error"]
    elif case.same_text:
        assert differences(plain["body"], tree["body"]) == []
    else:
        assert choice_count(tree) == choice_count(plain) == case.body.get("n", 1), (plain, tree)


def test_the_cases_exercise_what_they_name(answers):
    """The parity above could hold with an option ignored on both servers, or
    with no tree ever verified: rule both out."""
    tree = answers["tree"]
    text = {name: result["body"]["choices"][0]["message"]["content"]
            for name, result in tree.items()
            if name.startswith("chat-") and "stream" not in name and result["status"] == 200}
    assert text["chat-logit_bias"] != text["chat-greedy"]
    assert text["chat-bad_words"] != text["chat-greedy"]
    assert text["chat-repetition_penalty"] != text["chat-greedy"]
    assert text["chat-min_p-seeded"] != text["chat-seeded-hot"]
    assert text["chat-presence_penalty"] != text["chat-facts"]
    assert text["chat-frequency_penalty"] != text["chat-facts"]
    assert json.loads(text["chat-structured-json"]).keys() == {"name", "age"}
    usage = {name: tree[name]["body"]["usage"]["completion_tokens"] for name in text}
    finish = {name: tree[name]["body"]["choices"][0]["finish_reason"] for name in text}
    # min_tokens binds: without it the answer stops at its 40th token, with 40 it may not and runs on;
    # ignore_eos runs to max_tokens, past a grammar's end too.
    assert finish["chat-facts"] == "stop" and usage["chat-facts"] <= 40 < usage["chat-min_tokens"], usage
    assert finish["chat-ignore_eos"] == "length" and usage["chat-ignore_eos"] == 40, (finish, usage)
    assert usage["chat-ignore_eos-regex"] == 8 and usage["chat-ignore_eos-json_object"] == 24, usage
    # A grammar that ends before min_tokens: its stop token is all it allows, so it stays (vLLM's restore).
    assert finish["chat-choice-min_tokens"] == "stop" and usage["chat-choice-min_tokens"] < 12, usage
    assert text["chat-choice-min_tokens"] in ("the quick brown fox", "the lazy dog")
    # What speculation did per request (vLLM's report): nothing for a request that switched it off,
    # trees for the same request with it on.
    spec = {name: result.get("spec") for name, result in tree.items() if isinstance(result, dict)}
    assert spec["chat-speculation-off"]["num_spec_steps"] == spec["chat-speculation-off"]["num_draft_tokens"] == 0
    assert spec["chat-speculation-on"]["num_spec_steps"] > 0 and spec["chat-greedy"]["num_spec_steps"] > 0, spec
    # Trees were verified (27 in one run; the adaptive budget drafts where trees pay). Logprobs of
    # ``logprob_token_ids`` read from tree rows: ``test_verifier_sampling.py``.
    assert answers["counters"].get("vllm:spec_decode_num_drafts_total", 0) >= 10, answers["counters"]
