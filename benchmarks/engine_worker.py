"""The worker side of ``benchmarks/engines.py``: a job's engine opened
(:func:`open_engine`), prompts run with at most ``b`` requests in flight
(:func:`generate`), one timed pass with vLLM's spec-decode counters and the
plugin's ``adaptive_tree_stats`` read before and after (:func:`timed_pass`),
turns taken through the gate directory, and :func:`worker`, which runs a
job's passes (``engines.py --worker JOB``)."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path


SPEC_COUNTERS = {
    "drafts": "vllm:spec_decode_num_drafts",
    "draft_tokens": "vllm:spec_decode_num_draft_tokens",
    "accepted_tokens": "vllm:spec_decode_num_accepted_tokens",
}


TREE_COUNTERS = ("draft_passes", "drafting_steps", "trees_verified", "tokens_accepted", "leaf_paths", "paused", "probes",
                 "trust_cuts")


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
vLLM's default is the V2 runner with asynchronous scheduling, the baseline a GPU user gets."""


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


def is_tree_method(job: dict) -> bool:
    return (job.get("speculative_config") or {}).get("method") == "adaptive_tree"


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


def sampling_options(sampling: dict) -> dict:
    """A job's extra sampling parameters (``--sampling``) as ``SamplingParams`` takes them."""
    options = dict(sampling)
    if "structured_outputs" in options:
        from vllm.sampling_params import StructuredOutputsParams

        options["structured_outputs"] = StructuredOutputsParams(**options["structured_outputs"])
    return options


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
    params = SamplingParams(temperature=job["temperature"], max_tokens=job["max_tokens"], ignore_eos=False,
                            **sampling_options(job.get("sampling", {})))
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
