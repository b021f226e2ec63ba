"""Run one real vLLM engine job in its own process and write the results as JSON.

Usage: python tests/engine_job.py JOB.json OUT.json
       python tests/engine_job.py --serve   (a fork server, see ``serve``)

JOB keys: model, prompt_token_ids (list of lists), max_tokens; optional:
dtype, speculative_config, temperature, top_p, top_k, seeds (one per prompt),
stop, ignore_eos, penalties (presence_penalty, frequency_penalty and repetition_penalty, for every request or, with penalized, for those prompt indices only), extras ({prompt index: sampling parameters}, e.g. logit_bias, min_p, structured_outputs), max_model_len, max_num_seqs, max_num_batched_tokens, attention_backend,
num_gpu_blocks_override, tensor_parallel_size, block_size, abort_after_steps ({prompt index: engine steps}),
pause_pattern ([d, p] or [d, p, k]: the plugin drafts d steps, then pauses p steps, as
the load budget does when drafting does not pay; repeated; with k, the first drafting
step of each cycle is a probe that drafts for k requests), paused_controls (with a
pause_pattern: the first paused step of each cycle is a control step, draft-free for every
part of the drafter, as the load budget's control steps are), record_roots (a model drafter's
root draft distribution at every drafting step, see ``record_roots``), stash_bytes (an
EAGLE-3 head's bound on kept rows of paused steps; the out key stash_drops counts the
steps on which requests gave theirs up), max_pass_rows (the most rows of a model drafter's forward; longer
first passes are fed in several), pad_draft_passes (m: every model-drafter forward padded to a
multiple of m rows through the drafter's persistent buffers, as a CUDA graph's capture size
pads it; the out key padded_draft_passes counts them),
fail_for ({place: prompt index}: the plugin's per-request work raises for that prompt's
request: "drafting" (the retrieval drafter's index update), "grammar_forcing",
"grammar_cut" (the scheduler's grammar walk over its tree), or "tree_rows" (every tree
row's processing in the verifier, on every third step with trees); the out key
injected_failures counts the raises), per_request_metrics (vLLM's
--per-request-spec-decode-metrics level; the out key spec_decode_metrics holds each
prompt's report),
serial_first (k: the first k prompts run one at a time, batch size 1, before the
others are submitted together), submit_after_steps ({prompt index: k}: that prompt is
submitted k engine steps after the others instead of with them).

max_model_len defaults to the longest prompt plus max_tokens plus 128 (so
drafting is never cut near the end), rounded up to a multiple of 128. The KV
cache is sized by ``vllm_adaptive_spec.kv_cache_size`` for max_num_seqs
requests of max_model_len tokens.
OUT: token_ids, texts, finish_reasons (per prompt; aborted prompts get None),
metrics (vLLM's spec-decode, preemption and prefix-cache counters),
tree_stats (the plugin's, when active; tree_stats_per_rank: every tensor-parallel rank's), num_gpu_blocks (the engine's KV blocks),
roots (with record_roots), stash_drops (with stash_bytes), split_passes (with
max_pass_rows: first passes fed in several), probes (with a pause_pattern's k: probes
that drafted for fewer requests than the batch held), probe_trees (with k: the most
trees a probe step drafted), paused_passes (with a pause_pattern and a model
drafter: draft-model forwards run on paused steps), draft_free_verifies (with a
pause_pattern: steps in which no request had drafts that still went through the tree verifier),
plugin_registered (whether the plugin registered itself in the engine's process),
step_guard (with step_guard: true, the plugin's value reads and operations per tree step, see
``tests/step_guard.py``).

Requests go through ``LLMEngine.add_request``/``step`` so a job can abort some
of them mid-generation. Each job runs in a fresh process (a fresh
interpreter, or a child forked by ``serve`` from one that has only imported
vLLM), so engines never share state.
The engine runs in this process (vLLM's in-process engine core and its
single-process executor: the same scheduler, worker and model runner; with
tensor parallelism its multiprocess executor, a worker process per rank),
which saves the interpreters vLLM would otherwise start and import itself
into (about 14 s of a 2-core machine each).
"""

import functools
import hashlib
import itertools
import json
import os
import sys


def pause_drafting(worker, drafting: int, paused: int, probe_requests: int | None = None,
                   controls: bool = False) -> None:
    """Replace the load budget's pause decision by a fixed pattern (sent into
    the worker with ``collective_rpc``); with ``probe_requests``, the first
    drafting step of each cycle is a probe that drafts for that many
    requests; with ``controls``, the first paused step is a control step.
    The hybrid's fill drafts on every paused step but the control steps, and
    verifies every node it grows (its budget is dropped, as with
    ``load_budget: fixed``): what its budget would keep depends on this
    machine's measured step costs, and a test of the fill's path must not."""
    from vllm_adaptive_spec.budget.pause_control import StepDecision

    steps = itertools.count()
    proposer = worker.model_runner.tree_proposer
    phase = [0]

    def begin_step() -> StepDecision:
        phase[0] = next(steps) % (drafting + paused)
        limit = probe_requests if phase[0] == 0 else None
        return StepDecision(drafts=phase[0] < drafting, limit=limit, control=controls and phase[0] == drafting)

    proposer.begin_step = begin_step
    proposer.fill_budget = None
    runner = worker.model_runner
    _count_calls(worker, "draft_free_verifies", runner.rejection_sampler, "forward",
                 lambda metadata, *args: not any(metadata.num_draft_tokens))
    if runner._draft_backend is not None:
        _count_calls(worker, "paused_passes", runner._draft_backend, "run", lambda *args, **kwargs: phase[0] >= drafting)
    if probe_requests is not None:
        _count_calls(worker, "probes", runner._draft_backend, "least_behind",
                     lambda count: count < runner.input_batch.num_reqs)
        worker.probe_trees = 0
        propose_trees = proposer.propose_trees

        def counting_probe_trees(*args, **kwargs):
            drafts = propose_trees(*args, **kwargs)
            if phase[0] == 0:
                worker.probe_trees = max(worker.probe_trees, sum(1 for tree in drafts if tree))
            return drafts

        proposer.propose_trees = counting_probe_trees


def _extras(job: dict, index: int) -> dict:
    """The prompt's own sampling parameters (``extras``: prompt index -> parameters;
    ``logit_bias`` keys arrive as JSON strings, ``structured_outputs`` as
    ``StructuredOutputsParams``' keyword arguments, e.g. ``{"json": schema}``)."""
    extras = dict(job.get("extras", {}).get(str(index), {}))
    if "logit_bias" in extras:
        extras["logit_bias"] = {int(token): bias for token, bias in extras["logit_bias"].items()}
    if "structured_outputs" in extras:
        from vllm.sampling_params import StructuredOutputsParams

        extras["structured_outputs"] = StructuredOutputsParams(**extras["structured_outputs"])
    return extras


def record_roots(worker) -> None:
    """After each first draft pass, record per drafting request ``[key, top-2
    tokens, top-2 probabilities, caught_up, padded]``: ``key`` names the
    prompt and the root's position (so equal keys mean equal contexts under
    greedy decoding), ``caught_up`` whether the pass fed rows of paused
    steps, ``padded`` whether it was laid out at fixed width."""
    runner = worker.model_runner
    backend = runner._draft_backend
    first_pass, feed_rows = backend.first_pass, backend._feed_rows
    worker.recorded_roots = recorded = []
    padded = [False]

    def feeding(rows, *args, **kwargs):
        padded[0] = rows.filled is not None
        return feed_rows(rows, *args, **kwargs)

    def recording(*args, **kwargs):
        paused_rows = getattr(backend, "paused_rows", None)  # an EAGLE-3 head's; a draft LM keeps none
        kept = {r for r in runner.input_batch.req_ids if paused_rows is not None and paused_rows.rows(r)}
        own_share = first_pass(*args, **kwargs)
        roots = backend.roots
        if roots is None:
            return own_share
        batch = runner.input_batch
        for row, k in enumerate(roots.index.tolist()):
            if k < 0:
                continue
            prompt = batch.token_ids_cpu[row, : int(batch.num_prompt_tokens[row])]
            key = f"{hashlib.sha1(prompt.tobytes()).hexdigest()}:{int(roots.context[row]) - 1}"
            recorded.append([key, roots.distribution.tokens[k, :2].tolist(), roots.distribution.probs[k, :2].tolist(),
                             batch.req_ids[row] in kept, padded[0]])
        return own_share

    backend.first_pass, backend._feed_rows = recording, feeding


def recorded_roots(worker) -> list:
    return worker.recorded_roots


def _count_calls(worker, name: str, owner, method: str, counts=lambda *args, **kwargs: True) -> None:
    """Wrap ``owner.method`` so that ``worker.<name>`` counts the calls that ``counts`` accepts."""
    call = getattr(owner, method)
    setattr(worker, name, 0)

    def counting(*args, **kwargs):
        setattr(worker, name, getattr(worker, name) + bool(counts(*args, **kwargs)))
        return call(*args, **kwargs)

    setattr(owner, method, counting)


def counter(worker, name: str) -> int | None:
    return getattr(worker, name, None)


def limit_stash(worker, stash_bytes: int) -> None:
    """Bound the EAGLE-3 stash of paused rows and count the steps on which requests give theirs up."""
    paused_rows = worker.model_runner._draft_backend.paused_rows
    paused_rows.limit_bytes = stash_bytes
    _count_calls(worker, "stash_drops", paused_rows, "give_up_largest")


def limit_pass_rows(worker, rows: int) -> None:
    """Bound a model drafter's forward and count the first passes it splits."""
    backend = worker.model_runner._draft_backend
    backend.max_pass_rows = rows
    _count_calls(worker, "split_passes", backend, "_feed_oldest", lambda pass_rows, *args: pass_rows.total() > rows)


def pad_draft_passes(worker, multiple: int) -> None:
    """Pad every model-drafter forward to a multiple of ``multiple`` rows, as
    vLLM's dispatcher pads one to a CUDA graph's capture size (the CPU has no
    graphs: the mode stays NONE, the padding path is the GPU's)."""
    native = worker.model_runner._draft_backend.native
    decide, limit = native._determine_batch_execution_and_padding, native.input_ids.shape[0]
    worker.padded_draft_passes = 0

    def padded(num_tokens, *args, **kwargs):
        mode, _, across_dp = decide(num_tokens, *args, **kwargs)
        num_input = min(-(-num_tokens // multiple) * multiple, limit)
        worker.padded_draft_passes += num_input != num_tokens
        return mode, num_input, across_dp

    native._determine_batch_execution_and_padding = padded


INJECTED: dict[str, int] = {}


def inject_failures(fail_for: dict[str, int]) -> None:
    """Make the plugin's per-request work raise (see ``fail_for`` above), in
    this process, where the in-process engine's scheduler and worker run."""
    from vllm_adaptive_spec.adapter import tree_scheduler, verifier
    from vllm_adaptive_spec.drafters.retrieval_native import NativeRetrievalDrafter
    from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter

    def failing(owner, name: str, place: str, fails) -> None:
        original = getattr(owner, name)

        def wrapper(*args, **kwargs):
            if fails(*args, **kwargs):
                INJECTED[place] = INJECTED.get(place, 0) + 1
                raise RuntimeError(f"injected failure: {place}")
            return original(*args, **kwargs)

        setattr(owner, name, wrapper)

    def victim(place: str, request_id: str) -> bool:  # vLLM appends a suffix to the id a request is added with
        return request_id.split("-")[0] == str(fail_for[place])

    if "drafting" in fail_for:  # the trie matcher in Python or native, whichever the engine took
        for drafter in (RetrievalDrafter, NativeRetrievalDrafter):
            failing(drafter, "prepare", "drafting", lambda self, ids, *a, **k: any(victim("drafting", i) for i in ids))
    if "grammar_forcing" in fail_for:
        failing(tree_scheduler.TreeScheduler, "_forced", "grammar_forcing",
                lambda self, grammar, request_id, limit: victim("grammar_forcing", request_id))
    if "grammar_cut" in fail_for:
        failing(tree_scheduler, "grammar_kept", "grammar_cut",
                lambda grammar, request_id, *a: victim("grammar_cut", request_id))
    if "tree_rows" in fail_for:
        calls = itertools.count()
        failing(verifier, "tree_row_targets", "tree_rows", lambda *a, **k: next(calls) % 3 == 0)


def _step_guard_report(worker) -> dict:
    import step_guard

    return step_guard.report(worker)


def main(job_path: str, out_path: str) -> None:
    with open(job_path, encoding="utf-8") as handle:
        job = json.load(handle)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if "pause_pattern" in job or job.get("record_roots") or "stash_bytes" in job or "max_pass_rows" in job \
            or "pad_draft_passes" in job or job.get("step_guard"):
        # collective_rpc pickles the function only with this set.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    if "fail_for" in job:
        inject_failures(job["fail_for"])
    llm = _engine(job)
    finished = _drive(llm.llm_engine, job)
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(_results(llm, job, finished), handle)


def _engine(job: dict):
    """The job's engine, with the job's instruments sent into its worker."""
    from vllm import LLM

    from vllm_adaptive_spec.kv_cache_size import engine_kwargs

    longest = max(len(ids) for ids in job["prompt_token_ids"]) + job["max_tokens"] + 128
    extra = {k: job[k] for k in ("max_num_batched_tokens", "num_gpu_blocks_override", "tensor_parallel_size") if k in job}
    if "per_request_metrics" in job:
        extra["per_request_spec_decode_metrics"] = job["per_request_metrics"]
    llm = LLM(
        **engine_kwargs(
            job["model"],
            job.get("dtype", "float32"),
            max_model_len=job.get("max_model_len", -(-longest // 128) * 128),
            max_num_seqs=job.get("max_num_seqs", 16),
            speculative_config=job.get("speculative_config"),
            block_size=job.get("block_size"),
            attention_backend=job.get("attention_backend"),
        ),
        **extra,
        # In this process, the engine core drives one worker in it, or several
        # tensor-parallel workers in processes of their own.
        distributed_executor_backend="mp" if job.get("tensor_parallel_size", 1) > 1 else "uni",
    )
    if "pause_pattern" in job:
        llm.collective_rpc(functools.partial(
            pause_drafting, **dict(zip(("drafting", "paused", "probe_requests"), job["pause_pattern"])),
            controls=bool(job.get("paused_controls"))))
    if job.get("record_roots"):
        llm.collective_rpc(record_roots)
    if "stash_bytes" in job:
        llm.collective_rpc(functools.partial(limit_stash, stash_bytes=job["stash_bytes"]))
    if "max_pass_rows" in job:
        llm.collective_rpc(functools.partial(limit_pass_rows, rows=job["max_pass_rows"]))
    if "pad_draft_passes" in job:
        llm.collective_rpc(functools.partial(pad_draft_passes, multiple=job["pad_draft_passes"]))
    if job.get("step_guard"):
        import step_guard

        llm.collective_rpc(step_guard.install)
    return llm


def _sampling_params(job: dict, index: int):
    from vllm import SamplingParams

    seeds = job.get("seeds") or [None] * len(job["prompt_token_ids"])
    return SamplingParams(
        temperature=job.get("temperature", 0.0),
        top_p=job.get("top_p", 1.0),
        top_k=job.get("top_k", 0),
        max_tokens=job["max_tokens"],
        seed=seeds[index],
        stop=job.get("stop"),
        ignore_eos=job.get("ignore_eos", False),
        logprobs=job.get("logprobs"),
        **(job.get("penalties", {}) if index in job.get("penalized", [index]) else {}),
        **_extras(job, index),
    )


def _drive(engine, job: dict) -> dict:
    """Submit the job's requests (the serial ones first, one at a time; the
    late ones after their steps), step until all have finished, aborting
    those due; each finished request's output by request id."""
    prompts = job["prompt_token_ids"]
    aborts = {str(k): v for k, v in job.get("abort_after_steps", {}).items()}
    later = {int(k): v for k, v in job.get("submit_after_steps", {}).items()}
    finished = {}
    steps = 0
    pending = {}  # prompt index -> the step count at which it is submitted

    def submit(index: int) -> None:
        engine.add_request(str(index), {"prompt_token_ids": prompts[index]}, _sampling_params(job, index))

    def drain() -> None:
        nonlocal steps
        while engine.has_unfinished_requests() or pending:
            for output in engine.step():
                if output.finished:
                    finished[output.request_id] = output.outputs[0]
            steps += 1
            due = [rid for rid, at in aborts.items() if at == steps and rid not in finished]
            if due:
                engine.abort_request(due)
            for index in [i for i, at in pending.items() if at == steps]:
                del pending[index]
                submit(index)

    serial = min(job.get("serial_first", 0), len(prompts))
    for index in range(serial):
        submit(index)
        drain()
    for index in range(serial, len(prompts)):
        if index in later:
            pending[index] = steps + later[index]
        else:
            submit(index)
    drain()
    # The workers learn which requests finished with the next step's schedule;
    # vLLM's server loop runs that step on its own, an offline loop must ask.
    engine.step()
    return finished


def _results(llm, job: dict, finished: dict) -> dict:
    """The OUT keys (see the module's docstring)."""
    def result(index):
        out = finished.get(str(index))
        if out is None:
            return None, None, None, None
        logprobs = None if out.logprobs is None else [
            {str(token): entry.logprob for token, entry in position.items()} for position in out.logprobs
        ]
        return list(out.token_ids), out.text, out.finish_reason, logprobs

    rows = [result(i) for i in range(len(job["prompt_token_ids"]))]
    metrics = {
        m.name: getattr(m, "value", None)
        for m in llm.get_metrics()
        if any(key in m.name for key in ("spec_decode", "preemptions", "prefix_cache"))
    }
    tree_stats = None
    if (job.get("speculative_config") or {}).get("method") == "adaptive_tree":
        tree_stats = llm.collective_rpc("adaptive_tree_stats")
    return {
        "token_ids": [r[0] for r in rows],
        "texts": [r[1] for r in rows],
        "finish_reasons": [r[2] for r in rows],
        "logprobs": [r[3] for r in rows],
        "metrics": metrics,
        "tree_stats": None if tree_stats is None else tree_stats[0],
        "tree_stats_per_rank": tree_stats,
        "num_gpu_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        # In this process vLLM loads its plugins before it configures logging, so
        # the plugin's "registered" line is not in the log; ask the plugin.
        "plugin_registered": getattr(sys.modules.get("vllm_adaptive_spec.plugin"), "_registered", False),
        "roots": llm.collective_rpc(recorded_roots)[0] if job.get("record_roots") else None,
        "step_guard": llm.collective_rpc(_step_guard_report)[0] if job.get("step_guard") else None,
        "injected_failures": dict(INJECTED) if "fail_for" in job else None,
        "spec_decode_metrics": [
            None if (out := finished.get(str(i))) is None or out.spec_decode_metrics is None
            else out.spec_decode_metrics.to_dict() for i in range(len(job["prompt_token_ids"]))
        ] if "per_request_metrics" in job else None,
        **{key: llm.collective_rpc(functools.partial(counter, name=key))[0] if setting in job else None
           for key, setting in (("stash_drops", "stash_bytes"), ("split_passes", "max_pass_rows"),
                                ("padded_draft_passes", "pad_draft_passes"),
                                ("probes", "pause_pattern"), ("probe_trees", "pause_pattern"),
                                ("paused_passes", "pause_pattern"),
                                ("draft_free_verifies", "pause_pattern"))},
    }


def serve() -> None:
    """Import vLLM once, then run each job in a child forked from this process.

    Importing vLLM costs about 14 s of a 2-core machine and an engine job
    about 20 s in all, so the suite's engine jobs spend most of their time
    importing; a forked child starts with the imports done and nothing else
    (no engine, no vLLM state: vLLM reads its environment variables lazily
    until an engine starts). One request per line on stdin, JSON with keys
    job, out, log (the child's stdout and stderr) and env (variables set in
    the child); two JSON lines answer it: ``{"pid": ...}`` at the fork and
    ``{"returncode": ...}`` when the child has exited. Used only where no
    CUDA device is visible: a CUDA driver initialized before a fork is not
    usable in the child."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever vLLM logs goes to stderr, the answers alone to stdout
    import gc

    import vllm  # noqa: F401  (the import every child shares)
    from vllm import LLM, SamplingParams  # noqa: F401

    # What every engine imports when it starts (about 780 modules, 2 s of a
    # child on a 2-core machine), imported here once instead.
    import vllm.model_executor.models.llama  # noqa: F401
    import vllm.v1.engine.core  # noqa: F401
    import vllm.v1.worker.cpu_worker  # noqa: F401
    # The vLLM modules the plugin checks its hooks in at each engine's start (0.6 s of a child),
    # imported here without installing anything.
    from vllm_adaptive_spec.adapter import engine_hooks, missing_hooks

    missing_hooks(engine_hooks("cpu"))

    gc.freeze()  # the imports' objects: the children's gc.collect calls skip them

    for line in sys.stdin:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        answers.flush()
        pid = os.fork()
        if pid == 0:
            answers.close()
            _run_forked(request)
        print(json.dumps({"pid": pid}), file=answers, flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"returncode": os.waitstatus_to_exitcode(status)}), file=answers, flush=True)


def _run_forked(request: dict) -> None:
    """The forked child: the job's environment and log, then exit (normally,
    so vLLM's exit handlers stop any processes the engine started).

    vLLM collects garbage explicitly as an engine starts and stops (seven
    full collections, for a GPU's memory profile): a short-lived child
    needs none of them, and they cost 0.8 s of each job's 3.4 s start on a
    2-core machine; the interpreter's own collection still runs."""
    import gc

    gc.collect = lambda generation=2: 0
    os.environ.update(request.get("env", {}))
    sys.stdin.close()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    try:
        main(request["job"], request["out"])
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.exit(1)
    sys.exit(0)


if __name__ == "__main__":
    if sys.argv[1:] == ["--serve"]:
        serve()
    else:
        main(sys.argv[1], sys.argv[2])
