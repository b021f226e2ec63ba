"""The benchmarks' engine helper: start an engine for a method, run prompts
through it, read vLLM's and the plugin's counters, interleave rounds.

Every engine runs in a fresh process (``engines.py --worker JOB.json``, or a
tool's own script with a worker of its own), so memory is freed and runs share
no state. A *job* is a JSON object: the model, dtype, ``max_model_len``,
``max_num_seqs``, the ``speculative_config`` (None: no speculation), the
conversations and, per timed pass, the batch sizes and prompt counts.

Interleaving: this machine's speed drifts by 10-20% over minutes, so a method
timed minutes after no speculation would take the drift for its own. With
:func:`run_interleaved` every method's engine starts (one at a time, or all
together where cores and device memory allow, as on a GPU machine) and stays
up, idle while another runs; at each batch size the methods take turns,
``rounds`` times, the order rotating each round, and a method's ratio to no
speculation is the median of its per-round ratios (:func:`compare`). Turns are
handed over through files in a gate directory (``JOB.gate_dir``).

Worker side: :func:`open_engine`, :func:`generate` (at most ``b`` requests in
flight, a new one submitted as one finishes), :func:`timed_pass` (one pass,
vLLM's spec-decode counters and the plugin's ``adaptive_tree_stats`` read
before and after) and :func:`worker`, which runs a job's passes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from benchmarks.options import REPO
from vllm_adaptive_spec.kv_cache_size import available_memory  # noqa: F401 - the runs' memory figure

HEAD = REPO / "heads" / "smollm2-135m-eagle3"
# vLLM's n-gram drafter as the benchmarks compare against it (K = 4).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
# vLLM's ``suffix`` at its defaults (SpeculativeConfig.suffix_decoding_*); num_speculative_tokens, which vLLM
# would default to the tree depth, is given so the KV cache is sized for it.
SUFFIX = {"method": "suffix", "num_speculative_tokens": 24, "suffix_decoding_max_tree_depth": 24}
# A model drafter's policy settings by name: each policy at its defaults, and at its largest documented
# depth (eagle2 also at depth 18); the floor sweep's cells and the step profile's ``@POLICY`` use them.
MODEL_POLICIES = {
    "chain": ("chain", {}),
    "eagle2": ("eagle2", {}),
    "eagle2-D18": ("eagle2", {"depth": 18}),
    "talon": ("talon", {"max_depth": 32}),
    "deagle": ("deagle", {"depth": 18}),
    "dynatree": ("dynatree", {}),
    "c2t": ("c2t", {"max_depth": 10}),
}
SUFFIX_BUILD_SCRIPT = REPO / "scripts" / "build_suffix_decoding.sh"
# vLLM prefixes a worker's lines with its rank (``[rank0]: ``) and its log
# lines with a level, a time and a source (``ERROR 12-01 04:35:50 [core.py:9] ``).
LINE_PREFIX = re.compile(r"^\s*(\[rank\d+\]:\s*)?((ERROR|WARNING|INFO|DEBUG|CRITICAL)\s+\S+\s+\S+\s+\[[^\]]*\]\s*)?")
EXCEPTION_LINE = re.compile(r"^[\w.]*(Error|Exception|Interrupt)\b.*:")


# --------------------------------------------------------------------------- settings and reports


def interleave_categories(prompts: list) -> list:
    """Round-robin over categories (in order of first appearance), so any
    prefix is balanced; prompt sets are stored category by category."""
    groups: dict[str, list] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    order, depth = [], 0
    while len(order) < len(prompts):
        order += [group[depth] for group in groups.values() if depth < len(group)]
        depth += 1
    return order


def greedy_job(model: str, prompts: list, dtype: str, max_tokens: int, batch_sizes: list[int],
               num_prompts: list[int], warmup: int = 2) -> tuple[dict, list]:
    """An interleaved in-process job without its ``speculative_config``:
    greedy answers of up to ``max_tokens`` to the first prompts of
    ``prompts`` (as many as the largest pass or the warm-up needs), at each
    batch size its ``num_prompts``. Returns the job and the prompts it uses."""
    prompts = prompts[: max(num_prompts + [warmup])]
    conversations = [p.messages for p in prompts]
    job = {
        "model": model, "dtype": dtype, "max_tokens": max_tokens, "warmup_prompts": warmup,
        "max_model_len": needed_model_len(model, conversations, max_tokens),
        "conversations": conversations, "categories": [p.category for p in prompts], "temperature": 0.0,
        "engine_layout": "in-process", "batch_sizes": batch_sizes, "num_prompts": num_prompts,
        "max_num_seqs": max(batch_sizes),
    }
    return job, prompts


def needed_model_len(model: str, conversations: list, max_tokens: int) -> int:
    """The longest chat prompt in tokens plus ``max_tokens`` plus 128 (so no
    method stops drafting near the end), rounded up to a multiple of 128."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = max(
        len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for messages in conversations
    )
    return -(-(longest + max_tokens + 128) // 128) * 128


def draft_lm_path() -> str:
    """The draft LM of ``vllm-adaptive-spec draft-lm`` (trained on first use, about 6 minutes)."""
    from vllm_adaptive_spec.training.train_draft_lm import ensure_draft_lm

    return str(ensure_draft_lm(layers=4, minutes=6.0))


def suffix_decoding_dir() -> tuple[str | None, str | None]:
    """Build (or find) Arctic Inference's suffix tree with ``scripts/build_suffix_decoding.sh``.
    Returns (the directory to put on PYTHONPATH, None) or (None, why not)."""
    env = dict(os.environ)
    if sys.prefix != sys.base_prefix and "VENV" not in env:
        env["VENV"] = sys.prefix  # build for the Python that runs the workers
    try:
        proc = subprocess.run(["bash", str(SUFFIX_BUILD_SCRIPT)], env=env, cwd=REPO,
                              capture_output=True, text=True, timeout=1200)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"suffix decoding build failed ({SUFFIX_BUILD_SCRIPT.name}): {exc}"
    lines = proc.stdout.strip().splitlines()
    if proc.returncode == 0 and lines and Path(lines[-1]).is_dir():
        return lines[-1], None
    said = [line for line in proc.stderr.strip().splitlines() if line.strip()]
    why = f"exit {proc.returncode}" + (f": {said[-1].strip()}" if said else "")
    return None, (f"arctic_inference.suffix_decoding not available: {SUFFIX_BUILD_SCRIPT.relative_to(REPO)} "
                  f"failed ({why})")


def suffix_env(suffix_dir: str) -> dict:
    """This process's environment with ``suffix_dir`` (from
    :func:`suffix_decoding_dir`) first on ``PYTHONPATH``, for a ``suffix`` engine."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [suffix_dir, os.environ.get("PYTHONPATH")]))}


# --------------------------------------------------------------------------- worker side


# What an engine process holds beyond its KV cache and its weights (torch, vLLM,
# oneDNN's kernels and scratch): its resident memory less those two, measured
# on vLLM 0.32's CPU build (SmolLM2-135M in float32, the five engines of one
# interleaved run, batch 1 to 64): 1.03-1.31 GiB for no speculation, `ngram`
# and the plugin, 1.74 GiB for `suffix` at batch 64. The typical engine's,
# so a run the machine holds is not refused.
ENGINE_RUNTIME_BYTES = int(1.4 * 2**30)


def engine_bytes(job: dict) -> int:
    """What one engine of ``job``'s shape takes: its KV cache (sized as it will
    ask vLLM for, ``kv_cache_size``), its target's and draft model's weights
    in the run's dtype, and the runtime an engine process measurably holds."""
    from vllm_adaptive_spec.kv_cache_size import DTYPE_BYTES, kv_cache_bytes

    kv = kv_cache_bytes(job["model"], max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
                        dtype=job["dtype"], speculative_config=job.get("speculative_config"))
    draft = (job.get("speculative_config") or {}).get("model")
    weights = 0
    for model in filter(None, (job["model"], draft)):
        stored = sum(f.stat().st_size for f in Path(model).glob("*.safetensors"))
        try:
            stored_dtype = json.loads((Path(model) / "config.json").read_text()).get("torch_dtype")
        except (OSError, ValueError):
            stored_dtype = None
        scale = DTYPE_BYTES.get(job["dtype"], 2) / DTYPE_BYTES.get(stored_dtype, DTYPE_BYTES.get(job["dtype"], 2))
        weights += int(stored * scale)
    return kv + weights + ENGINE_RUNTIME_BYTES


def memory_problem(jobs: dict[str, dict], together: bool, available: int | None) -> str | None:
    """Why the jobs' engines cannot fit this machine's ``available`` bytes of
    memory, or None: what each engine measurably takes (:func:`engine_bytes`),
    all at once when ``together`` (interleaved engines), else the largest; the
    refusal names how many fit together and what to change."""
    if available is None:
        return None
    needs = {name: engine_bytes(job) for name, job in jobs.items()}
    total = sum(needs.values()) if together else max(needs.values())
    if total <= available:
        return None
    each = ", ".join(f"{name} {need / 2**30:.1f} GiB" for name, need in needs.items())
    how = "together" if together else "at most one at a time"
    fits, used = 0, 0
    for need in sorted(needs.values()):
        used += need
        fits += used <= available
    if fits == 0 or not together:
        what = "not one engine fits: use smaller batch sizes or shorter prompts"
    else:
        what = (f"{fits} of these {len(needs)} engines fit together: run at most {fits} methods at a time, "
                "or --engine-per method (one engine at a time)")
    return (f"the engines need {total / 2**30:.1f} GiB {how} (KV cache, weights and runtime: {each}) and this "
            f"machine has {available / 2**30:.1f} GiB available; {what}")


# --------------------------------------------------------------------------- driver side


@dataclass
class Engine:
    """A worker process serving one engine job."""

    proc: subprocess.Popen
    job: dict
    log_path: Path
    result_path: Path
    started: float


def start_engine(job: dict, work: Path, label: str, env: dict | None = None, script: Path | None = None) -> Engine:
    """Start one engine job in a fresh process (``script --worker JOB``,
    default this module; environment ``env``, default this process's), the
    script's checkout first on ``PYTHONPATH``: a worker runs its own
    checkout's packages (``before_after.py`` runs two), not an installed copy."""
    job_path = work / f"{label}.job.json"
    log_path = work / f"{label}.log"
    result_path = work / f"{label}.result.json"
    result_path.unlink(missing_ok=True)
    job = {**job, "result_path": str(result_path), "label": label}
    job_path.write_text(json.dumps(job), encoding="utf-8")
    script = script or Path(__file__).resolve()
    env = dict(env if env is not None else os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(script.parent.parent), env.get("PYTHONPATH")]))
    with log_path.open("w", encoding="utf-8") as log:
        # Its own session, so a timeout can end the worker with the engine processes it spawned.
        proc = subprocess.Popen(
            [sys.executable, str(script), "--worker", str(job_path)],
            stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env, start_new_session=True,
        )
    return Engine(proc, job, log_path, result_path, time.perf_counter())


def take_turn(engine: Engine, name: str, timeout_s: float) -> bool:
    """Interleaved runs: give ``engine`` the turn ``name`` and wait until it is
    done (False if the worker exits or the time runs out first)."""
    gate = Path(engine.job["gate_dir"])
    (gate / f"{engine.job['label']}.{name}.go").touch()
    done = gate / f"{engine.job['label']}.{name}.done"
    deadline = time.perf_counter() + timeout_s
    while not done.exists():
        if engine.proc.poll() is not None or time.perf_counter() > deadline:
            return False
        time.sleep(0.05)
    return True


def finish_engine(engine: Engine, timeout_s: float) -> dict:
    """Wait for the worker. Returns its result (the passes it finished), with
    ``error``, ``log`` and ``log_tail`` added when it did not finish."""
    error = None
    try:
        returncode = engine.proc.wait(timeout=max(timeout_s - (time.perf_counter() - engine.started), 1.0))
    except subprocess.TimeoutExpired:
        os.killpg(engine.proc.pid, signal.SIGKILL)
        engine.proc.wait()
        returncode = None
        error = f"worker timed out after {timeout_s:.0f} s"
    if returncode not in (0, None):
        error = f"worker exited with {returncode}"
    path = engine.result_path
    result = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"runs": []}
    result["process_s"] = time.perf_counter() - engine.started
    done = {run["batch_size"] for run in result["runs"]}
    if error is None and done != set(engine.job["batch_sizes"]):
        error = "worker finished without all results"
    if error is not None:
        tail = engine.log_path.read_text(encoding="utf-8", errors="replace").splitlines()[-80:]
        raised = last_error_line(tail)
        result["error"] = f"{error}: {raised}" if raised else error
        result["log"] = str(engine.log_path)
        result["log_tail"] = tail
    return result


def last_error_line(lines: list[str]) -> str | None:
    """The last exception line of a worker's log (``ValueError: ...``), with
    vLLM's rank and log prefixes taken off, so a failed engine's row says why."""
    raised = [LINE_PREFIX.sub("", line, count=1).strip() for line in lines]
    raised = [line for line in raised if EXCEPTION_LINE.match(line)]
    return raised[-1] if raised else None


def run_engine(job: dict, work: Path, label: str, timeout_s: float, env: dict | None = None,
               script: Path | None = None) -> dict:
    """Run one engine job to its end (start it, then wait for it)."""
    return finish_engine(start_engine(job, work, label, env, script), timeout_s)


def run_interleaved(jobs: dict[str, dict], work: Path, rounds: int, timeout_s: float,
                    env_for: Callable[[str], dict | None] = lambda name: None,
                    log: Callable[[str], None] = print,
                    script_for: Callable[[str], Path | None] = lambda name: None,
                    start_together: bool = False,
                    progress: Callable[[dict[str, dict]], None] | None = None) -> dict[str, dict]:
    """Every job's engine up at once, their passes alternating (see the
    module's docstring); every job has the same ``batch_sizes``. Job
    ``name`` runs in ``script_for(name)`` (default this module; another
    checkout's ``benchmarks/engines.py`` runs that checkout's code) with
    environment ``env_for(name)``. The engines start one after another, or
    with ``start_together`` all at once (startup is not timed against other
    work; on a GPU machine it is mostly compilation and CUDA graph capture,
    which overlap well). Returns each job's result, as :func:`finish_engine`;
    ``progress(results so far)`` runs after every batch size's rounds (the
    passes each worker has finished, :func:`partial_result`)."""
    gate = work / "gate"
    shutil.rmtree(gate, ignore_errors=True)
    gate.mkdir(parents=True)
    live = {name: start_engine({**job, "gate_dir": str(gate), "rounds": rounds}, work, f"{name}-interleaved",
                               env_for(name), script_for(name))
            for name, job in jobs.items()}
    results: dict[str, dict] = {}

    def give_up(name: str) -> None:
        """A worker that exited or ran out of time: keep what it finished."""
        results[name] = finish_engine(live.pop(name), 1.0)

    if start_together:
        log(f"{len(jobs)} engines start together")
        for engine in live.values():
            (gate / f"{engine.job['label']}.start.go").touch()
    for index, name in enumerate(list(live), 1):
        log(f"engine {index}/{len(jobs)}: {name} starts")
        if not take_turn(live[name], "start", timeout_s):
            give_up(name)
    batch_sizes = next(iter(jobs.values()))["batch_sizes"] if jobs else []
    for b in batch_sizes:
        for round_index in range(rounds):
            order = list(live)
            shift = round_index % len(order) if order else 0
            order = order[shift:] + order[:shift]
            log(f"b={b} round {round_index + 1}/{rounds}: {', '.join(order)}")
            for name in order:
                if not take_turn(live[name], f"b{b}-r{round_index}", timeout_s):
                    give_up(name)
        if progress is not None:
            progress({**results, **{name: partial_result(engine) for name, engine in live.items()}})
    for name, engine in live.items():
        results[name] = finish_engine(engine, timeout_s)
    return results


def partial_result(engine: Engine) -> dict:
    """The passes a live worker has finished (it writes them after every pass)."""
    try:
        return json.loads(engine.result_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"runs": []}


def run_apart(module: str, argv: list[str], out: Path, one: str, result: Path) -> dict:
    """``python -m benchmarks.MODULE ARGV --out OUT --one ONE`` in a process
    of its own (an engine's memory is not all returned when it shuts down in
    the process that opened it): the JSON it leaves at ``result``, or the
    error it ended with."""
    result.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", *argv, "--out", str(out), "--one", one],
                          capture_output=True, text=True)
    if not result.exists():
        lines = (done.stderr or done.stdout).strip().splitlines()
        return {"error": f"exit {done.returncode}: {lines[-1] if lines else 'no output'}"}
    return json.loads(result.read_text())


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run one benchmark engine job (started by the benchmark tools).")
    parser.add_argument("--worker", metavar="JOB_JSON", required=True)
    from benchmarks.engine_worker import worker

    worker(parser.parse_args().worker)
