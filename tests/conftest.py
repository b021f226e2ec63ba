"""Shared fixtures: the demo model and a runner for real engine jobs."""

from __future__ import annotations

import json
import os
import re
import shutil

# Triton kernels run under the interpreter on machines without an NVIDIA GPU;
# it must be set before triton is first imported.
if shutil.which("nvidia-smi") is None:
    os.environ.setdefault("TRITON_INTERPRET", "1")
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
# The project's committed EAGLE-3 head for the demo model.
HEAD = str(TESTS.parent / "heads" / "smollm2-135m-eagle3")
# The plugin's line on registering, in a vLLM log whose prefix names the process:
# "(EngineCore pid=...)", "(VllmWorker-0 pid=...)", "(MainProcess pid=...)".
REGISTERED = re.compile(r"\(([\w-]+) pid=(\d+)\).*vllm-adaptive-spec \S+ registered")


@pytest.fixture(scope="session")
def demo_model() -> str:
    from vllm_adaptive_spec.demo_model import ensure_demo_model

    return str(ensure_demo_model())


@pytest.fixture(scope="session")
def demo_tokenizer(demo_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(demo_model)


# The default config's drafter (retrieval, N = 16, the adaptive budget).
PARITY_SPEC = {"method": "adaptive_tree", "num_speculative_tokens": 16, "tree": {"drafter": "retrieval"}}


@pytest.fixture(scope="session")
def parity_servers(demo_model, tmp_path_factory):
    """``({"none": server, "tree": server}, log folder)``: a server without
    speculation and one with ``PARITY_SPEC``, both healthy, started once for
    the parity and fuzz tests (a start of two servers is minutes on a 2-core
    machine); stopped at the end of the session."""
    from benchmarks import serve_load
    from benchmarks.serving.servers import Server, free_port

    out, servers = tmp_path_factory.mktemp("parity_servers"), {}
    try:
        for label, spec in (("none", None), ("tree", PARITY_SPEC)):
            args = serve_load.server_args(demo_model, 1024, 4, "float32", spec, chunked=False)
            args += ["--max-num-seqs", "8", "--distributed-executor-backend", "uni"]
            if spec is not None:  # vLLM's per-request report of what speculation did
                args += ["--per-request-spec-decode-metrics", "summary"]
            servers[label] = Server(demo_model, free_port(), spec, args, out / f"{label}.log")
        for server in servers.values():
            server.wait_healthy()
        yield servers, out
    finally:
        for server in servers.values():
            server.stop()


@dataclass
class EngineRun:
    token_ids: list[list[int] | None]
    texts: list[str | None]
    finish_reasons: list[str | None]
    logprobs: list[list[dict[str, float]] | None]  # per request and position: token id -> logprob
    metrics: dict
    tree_stats: dict | None  # tensor-parallel rank 0's
    tree_stats_per_rank: list[dict] | None
    num_gpu_blocks: int | None
    roots: list | None
    stash_drops: int | None
    split_passes: int | None
    padded_draft_passes: int | None
    probes: int | None
    probe_trees: int | None
    paused_passes: int | None
    draft_free_verifies: int | None
    plugin_registered: bool
    step_guard: dict | None
    injected_failures: dict | None
    spec_decode_metrics: list[dict | None] | None
    log: str

    @property
    def tau(self) -> float:
        """Tokens committed per step for steps that verified drafts (vLLM's counters)."""
        drafts = self.metrics.get("vllm:spec_decode_num_drafts", 0)
        return 1.0 + self.metrics.get("vllm:spec_decode_num_accepted_tokens", 0) / max(drafts, 1)


def _job_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


STARTUP_SECONDS = 300


class _ForkServer:
    """``tests/engine_job.py --serve``, started on first use: it imports vLLM
    once and forks a fresh child for each engine job (see its ``serve``)."""

    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def run(self, job_file: Path, out_file: Path, log_file: Path, env: dict[str, str], timeout: float) -> int:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = subprocess.Popen(
                [sys.executable, str(TESTS / "engine_job.py"), "--serve"],
                env=_job_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
            )
        request = {"job": str(job_file), "out": str(out_file), "log": str(log_file), "env": env}
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        # The server imports vLLM before it forks its first child: minutes on a loaded 2-core machine.
        pid = json.loads(self._answer(STARTUP_SECONDS))["pid"]
        try:
            return json.loads(self._answer(timeout))["returncode"]
        except TimeoutError:
            os.kill(pid, signal.SIGKILL)
            self._answer(60)
            raise

    def _answer(self, timeout: float) -> str:
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            raise TimeoutError(f"no answer from the engine job server in {timeout:.0f} s")
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the engine job server exited ({self.proc.wait()})")
        return line

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            self.proc.wait(timeout=STARTUP_SECONDS)


_FORK_SERVER = _ForkServer()
# Without a CUDA device, jobs run in children of one fork server (about 14 s of
# imports saved per job on a 2-core machine); with one, each in a fresh interpreter.
_USE_FORK_SERVER = shutil.which("nvidia-smi") is None


def pytest_sessionfinish(session, exitstatus):
    _FORK_SERVER.close()


# Command lines that start a vLLM engine (the engine job, a benchmark's
# worker or one-config child, the demo, a server, the GPU script's dry run).
ENGINE_COMMAND = re.compile(r"engine_job\.py|engine_worker|--one\b|vllm_adaptive_spec\.demo\b|"
                            r"\bvllm serve\b|gpu_checks\.sh --dry-run")


class UnmarkedEngineTest(Exception):
    """A test started an engine without the ``engine`` mark, so the quick tier
    (``-m "not engine"``) would not be quick."""


_engine_allowed = False


def refuse_unmarked_engine(what: str) -> None:
    if not _engine_allowed:
        raise UnmarkedEngineTest(f"{what}: a test that starts an engine needs @pytest.mark.engine")


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    """Whether the test about to run (its fixtures of every scope included,
    which are set up after this) may start an engine: only with the mark."""
    global _engine_allowed
    _engine_allowed = item.get_closest_marker("engine") is not None


# ``scripts/test_lanes.sh`` (``make test``) runs the suite in two pytest processes, one per
# core; these modules are lane 1's, about half the suite's time on 2 cores, and every other module
# is lane 0's. Modules that share a session fixture (the parity servers) stay in one lane.
LANE_1 = frozenset({
    "test_engine_tree.py", "test_gpu_script.py", "test_engine_uniform_steps.py", "test_engine_structured.py",
    "test_serve_load.py", "test_demo.py",
})


# This process's lane, taken out of the environment so that a pytest the tests start (the GPU
# script's collection of its tests) sees the whole suite.
LANE = os.environ.pop("TEST_LANE", None)


def pytest_collection_modifyitems(config, items):
    """With ``TEST_LANE`` set, only that lane's modules run."""
    if LANE is None:
        return
    mine = [(item.path.name in LANE_1) == (LANE == "1") for item in items]
    config.hook.pytest_deselected(items=[item for item, kept in zip(items, mine) if not kept])
    items[:] = [item for item, kept in zip(items, mine) if kept]


_popen_init = subprocess.Popen.__init__


def _guarded_popen_init(self, args, *rest, **kwargs):
    """Fails a process whose command line starts an engine, for a test
    without the ``engine`` mark (``run_engine_job`` checks the same)."""
    line = args if isinstance(args, str) else " ".join(map(str, args))
    if ENGINE_COMMAND.search(line):
        refuse_unmarked_engine(line[:200])
    _popen_init(self, args, *rest, **kwargs)


subprocess.Popen.__init__ = _guarded_popen_init


def run_engine_job(tmp_path: Path, job: dict, env: dict[str, str] | None = None) -> EngineRun:
    """Run tests/engine_job.py's job in a fresh process; fail with its log on error."""
    refuse_unmarked_engine("run_engine_job")
    tmp_path.mkdir(parents=True, exist_ok=True)
    job_file, out_file, log_file = tmp_path / "job.json", tmp_path / "out.json", tmp_path / "job.log"
    job_file.write_text(json.dumps(job))
    if _USE_FORK_SERVER:
        returncode = _FORK_SERVER.run(job_file, out_file, log_file, env or {}, timeout=600)
        log = log_file.read_text(errors="replace")
    else:
        proc = subprocess.run(
            [sys.executable, str(TESTS / "engine_job.py"), str(job_file), str(out_file)],
            env={**_job_env(), **(env or {})},
            capture_output=True,
            text=True,
            timeout=600,
        )
        returncode, log = proc.returncode, proc.stdout + proc.stderr
    if returncode != 0:
        pytest.fail(f"engine job failed (exit {returncode}):\n{log[-6000:]}")
    return EngineRun(**json.loads(out_file.read_text()), log=log)


def chat_token_ids(tokenizer, messages: list[dict[str, str]]) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
