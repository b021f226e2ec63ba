"""The serve-load workload: a seeded mix of requests a real server sees (every
sampling option, streaming, ``n``, logprobs, stops, penalties, structured output,
bad input), drawn from held-out prompts, and the warm-up jobs."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass, field
from pathlib import Path

from benchmarks.options import HELDOUT


DEFAULT_SPEC = {"method": "adaptive_tree", "num_speculative_tokens": 16, "tree": {"drafter": "retrieval"}}
PLAIN = "none"  # the server without speculation
SHARED_SYSTEM = (
    "You are a careful assistant for a software team. Answer in plain language, keep answers short, "
    "show code when it helps, and say when you are unsure. The team works in Python and C, ships a "
    "web service and a command-line tool, and values tests, clear names and small functions. "
) * 3
JSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "count": {"type": "integer"}},
    "required": ["name", "count"],
}
# Shares of the workload (the rest is plain greedy).
MIX = {"sampled": 0.10, "seeded": 0.12, "n2": 0.05, "logprobs": 0.08, "stop": 0.07, "penalty": 0.07,
       "json": 0.05, "min_p": 0.04, "logit_bias": 0.04, "bad": 0.03, "opt_out": 0.05}
LONG_SHARE, SHARED_SHARE, COMPLETIONS_SHARE, STREAM_SHARE, DISCONNECT_SHARE = 0.15, 0.15, 0.2, 0.5, 0.08


@dataclass
class Job:
    """One request of the workload and how its client behaves."""

    index: int
    kind: str
    endpoint: str  # "chat" or "completions"
    body: dict
    stream: bool
    disconnect_after: int | None  # streamed chunks read before the client goes away

    @property
    def greedy(self) -> bool:
        """Deterministic answers, compared between the two servers."""
        return (self.kind in ("greedy", "logprobs", "stop", "penalty", "json", "logit_bias", "opt_out")
                and self.disconnect_after is None)


@dataclass
class Outcome:
    index: int
    kind: str
    status: int | None = None
    error: str | None = None
    token_ids: list[list[int]] = field(default_factory=list)  # per choice
    finish_reasons: list[str | None] = field(default_factory=list)
    disconnected: bool = False
    started: float = 0.0
    first_token: float | None = None
    finished: float = 0.0
    token_times: list[float] = field(default_factory=list)


def workload(count: int, seed: int, max_model_len: int, model: str, max_tokens_cap: int = 512,
             prompt_file: Path | None = None) -> list[Job]:
    """``count`` requests drawn with ``seed`` (the same list for both servers),
    ``max_tokens`` log-uniform from 1 to ``max_tokens_cap``, questions from
    ``prompt_file`` (default the project's prompts)."""
    from vllm_adaptive_spec.prompts import load_prompts

    rng = random.Random(seed)
    prompts = [p.messages[-1]["content"] for p in load_prompts(prompt_file)]
    kinds = list(MIX) + ["greedy"]
    weights = list(MIX.values()) + [1 - sum(MIX.values())]
    jobs = []
    for index in range(count):
        kind = rng.choices(kinds, weights)[0]
        question, system = _question(rng, prompts, max_model_len)
        max_tokens = min(int(math.exp(rng.uniform(0, math.log(max_tokens_cap)))), max_model_len // 4)
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0} | _options(rng, kind)
        if kind == "json":
            question = "Describe one fruit as JSON with a name and a count."
        endpoint = "completions" if rng.random() < COMPLETIONS_SHARE and kind not in ("json", "n2") else "chat"
        if endpoint == "chat":
            messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
            body |= {"messages": messages, "return_token_ids": True}
            if kind == "logprobs":
                body |= {"logprobs": True, "top_logprobs": 5}
        else:
            body |= {"prompt": (system + "\n\n" if system else "") + question, "return_token_ids": True}
        stream = rng.random() < STREAM_SHARE and kind != "n2"
        disconnect = rng.randint(1, 8) if stream and kind != "bad" and rng.random() < DISCONNECT_SHARE / STREAM_SHARE else None
        if stream:
            body |= {"stream": True}
        jobs.append(Job(index, kind, endpoint, body, stream, disconnect))
    return jobs


def _question(rng: random.Random, prompts: list[str], max_model_len: int) -> tuple[str, str | None]:
    """A request's question and system prompt: four questions at once, one
    behind the shared system prompt, or one alone; under half the model's
    length (about 4 characters a token)."""
    source = rng.random()
    if source < LONG_SHARE:
        question = "\n\n".join(rng.sample(prompts, 4)) + "\n\nAnswer the last question."
        system = None
    elif source < LONG_SHARE + SHARED_SHARE:
        question, system = rng.choice(prompts), SHARED_SYSTEM
    else:
        question, system = rng.choice(prompts), None
    return question[: 2 * max_model_len], system


def _options(rng: random.Random, kind: str) -> dict:
    """The sampling options of a request of ``kind``."""
    if kind == "sampled":
        return {"temperature": rng.uniform(0.6, 1.2), "top_p": 0.9, "top_k": 50}
    if kind == "seeded":
        return {"temperature": 1.0, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
    if kind == "n2":
        return {"temperature": 0.8, "n": 2, "seed": rng.randrange(1 << 30)}
    if kind == "logprobs":
        return {"logprobs": 5}
    if kind == "stop":
        return {"stop": [rng.choice(["\n\n", ".", "```"])]}
    if kind == "penalty":
        return {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
    if kind == "min_p":
        return {"temperature": 0.8, "min_p": 0.1}
    if kind == "logit_bias":
        return {"logit_bias": {str(rng.randrange(100, 30000)): rng.choice([-100, -5, 2]) for _ in range(4)}}
    if kind == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": JSON_SCHEMA}}}
    if kind == "bad":
        return {"temperature": -1.0}
    if kind == "opt_out":  # greedy, speculation switched off for this request (ignored without the plugin)
        return {"vllm_xargs": {"speculation": "off"}}
    return {}


def warmup_jobs(count: int, max_model_len: int, model: str) -> list[Job]:
    """``count`` greedy completions of random token ids, each prompt a length
    of its own from 8 to a quarter of the model's length (where the
    workload's prompts and decode batches mostly lie; longer ones cost the
    warm-up more than they show), 4 tokens each: sent one at
    a time before the measured run, they give every weight of vLLM's CPU
    build ``count`` row counts. That build keeps a oneDNN matmul primitive
    for each of the last 32 row counts a weight has seen, and oneDNN's cache
    (capped by :func:`server_env`) as many per weight shape, so with
    ``count`` above 32 those caches are full before memory is read; without
    it a server's memory grows for the first thousands of seconds of a run
    with or without speculation (``docs/benchmarking.md``)."""
    rng = random.Random(-1)
    top = max_model_len // 4
    lengths = [8 + (top - 8) * i // max(count - 1, 1) for i in range(count)]
    return [Job(-1 - i, "warmup", "completions",
                {"model": model, "prompt": [rng.randrange(100, 40000) for _ in range(length)], "max_tokens": 4,
                 "temperature": 0.0, "return_token_ids": True}, False, None)
            for i, length in enumerate(lengths)]


def batch_warmup_jobs(count: int, max_model_len: int, model: str, max_tokens_cap: int = 512) -> list[Job]:
    """``count`` requests of the workload's mix, drawn from the held-out
    prompts (``benchmarks/data/heldout_prompts.jsonl``, never the measured
    questions, so no drafter state learnt here helps the run), sent at the
    run's concurrency after the one-at-a-time warm-up. Steps of many
    requests, with their trees, are where a server's largest step-sized
    buffers and the draft model's matmul primitives for batched row counts
    first appear; one request at a time never shows them."""
    jobs = workload(count, -1, max_model_len, model, max_tokens_cap, HELDOUT)
    return [Job(-1 - job.index, "warmup", job.endpoint, job.body, job.stream, job.disconnect_after) for job in jobs]
