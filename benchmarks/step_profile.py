"""Where an engine step's time goes, per method and batch size (CPU or GPU).

For every method and batch size b: b requests in flight (``max(b, 4)`` prompts
in all, round-robin over the prompt categories, greedy, ``--max-tokens``
each), the engine stepped by hand. Each step's wall time is measured around
``LLMEngine.step``; inside the worker the phases are timed by
``benchmarks.phase_times``. The table gives milliseconds per
engine step (self time: a phase's time without the phases inside it):

* ``forward``: the target model without attention; ``attn``: vLLM's C++
  attention in the target forward; ``tree_attn``: tree rows (torch/Triton);
* ``prepare``: input layout (vLLM's and the tree layout);
* ``verify``: sampling and tree verification; ``compact``: KV compaction
  (and the load budget's observations);
* ``draft``: the drafter: ``grow`` (the tree proposer: index updates, policy,
  tree assembly), ``dpass`` (model drafters' passes, their attention
  included), ``dbook`` (a model drafter's bookkeeping around its pass over
  the committed tokens: gathers, the paused rows it keeps), ``draft_self``
  (the rest of vLLM's / the plugin's drafting);
* ``runner``: the rest of the worker's ``execute_model`` / ``sample_tokens``;
  ``engine``: the step's wall time outside the worker (scheduler, IPC,
  detokenisation);
* ``leaf``: the share of verified trees whose accepted path reached a leaf,
  and ``overlap <=``: that share of the drafting time (``grow``, ``dpass``,
  ``dbook``, ``draft_self``) over the step time. Talon's overlapped rounds draft step
  ``t + 1`` during step ``t``'s forward on a guessed outcome of ``t`` (a whole
  path accepted, and the bonus token); the guess is right at most on the
  ``leaf`` share, so an overlap saves at most ``overlap <=`` of the step time
  (less for EAGLE-3, which needs step ``t``'s hidden states to draft at all);
* ``graphs``: how many forwards replayed a FULL CUDA graph, a PIECEWISE one,
  or none (always ``NONE`` on the CPU); ``draft graphs``: the same for a
  model drafter's passes (the first pass and every tree layer), which replay
  the PIECEWISE graphs vLLM captured for its drafter.

Methods: ``none``, ``vllm-eagle3-K`` (vLLM's EAGLE-3 chain of K with ``--head``), ``none-v1-sync`` (no
speculation on the plugin's runner and scheduling: vLLM's V1 runner, synchronous), ``ngram`` (vLLM's, K=4),
``suffix`` (vLLM's, at its defaults; not in lockstep), ``tree-N`` (adaptive_tree retrieval, ``load_budget:
fixed`` at N), ``tree-adaptive-N`` (the default load budget, at most N) and ``tree-0`` (adaptive_tree whose
suffix can never match: the plugin's cost with no tree at all); ``eagle3-N`` / ``draft-lm-N``: the model
drafters (EAGLE-2 trees of N nodes, ``load_budget: fixed``; the head of ``--head``, the draft LM of
``vllm-adaptive-spec draft-lm``), whose ``dpass`` share bounds what overlapping drafting with verification
could save; ``eagle3-adaptive-N`` / ``draft-lm-adaptive-N``: the same under the default load budget (what a
model drafter costs while the budget pauses it); ``hybrid-N`` / ``hybrid-adaptive-N``: the EAGLE-3 head's
EAGLE-2 tree merged with the retrieval trie (Talon's hybrid), likewise. ``@POLICY`` after a model drafter's
name picks its policy (``eagle3-adaptive-32@talon``), ``@POLICY:KEY=VALUE:...`` its settings too
(``eagle3-4@eagle2:top_k=4:depth=1``: one pass, four wide).

For ``adaptive_tree`` methods, rows marked ``[drafting]``, ``[probe]``, ``[paused]`` and ``[no proposal]``
split the steps by what the step's proposal did (the plugin's counters read after every step, outside its
timing): what a paused drafter costs per step, and what a probe costs.

Reproduce (about 12 minutes on 2 CPU cores; writes ``step_profile.{json,md}``)::

    .venv/bin/vllm-adaptive-spec bench step-profile
    .venv/bin/vllm-adaptive-spec bench step-profile --methods none,tree-16 --batch-sizes 8
    .venv/bin/vllm-adaptive-spec bench step-profile --methods none,tree-0,tree-adaptive-16 --batch-sizes 8 \
        --sampling '{"repetition_penalty": 1.1}' --engine-layout lockstep

``--sampling`` adds sampling parameters to every (greedy) request, as in ``bench throughput``."""

from __future__ import annotations

import argparse
import gc
import json
import os
import time
from collections import Counter
from pathlib import Path

from benchmarks import engine_worker, engines
from benchmarks.options import add_batches, add_output, add_sampling, add_workload
from benchmarks.phase_times import DRAFT_GRAPH_KEY, GRAPH_KEY
from benchmarks.report import write_report


MAX_LEN = 64  # l_max = l_min = 64: the suffix never matches, no tree is drafted


def method_config(name: str) -> dict | None:
    """The speculative config of a method name (Methods above; ``@POLICY`` in ``engines.MODEL_POLICIES``)."""
    name, _, policy = name.partition("@")
    policy, *settings = policy.split(":")
    if name in ("none", "none-v1-sync"):
        return None
    if name in ("ngram", "suffix"):
        return dict(engines.NGRAM if name == "ngram" else engines.SUFFIX)
    if name.startswith("vllm-eagle3-"):
        return {"method": "eagle3", "num_speculative_tokens": int(name.rsplit("-", 1)[1])}
    if name.startswith("tree-"):
        adaptive = name.startswith("tree-adaptive-")
        nodes = int(name.rsplit("-", 1)[1])
        tree = {"drafter": "retrieval", "policy": "retrieval", "load_budget": "adaptive" if adaptive else "fixed"}
        if nodes == 0:
            tree.update(l_max=MAX_LEN, l_min=MAX_LEN)
        return {"method": "adaptive_tree", "num_speculative_tokens": max(nodes, 1), "tree": tree}
    for prefix, drafter in (("eagle3-", "eagle3"), ("draft-lm-", "draft_model"), ("hybrid-", "hybrid")):
        if name.startswith(prefix):
            adaptive = name.startswith(prefix + "adaptive-")
            policy, params = engines.MODEL_POLICIES.get(policy or "eagle2", (policy, {}))
            params = {k: int(v) for k, _, v in (item.partition("=") for item in settings)} if settings else params
            return {"method": "adaptive_tree", "num_speculative_tokens": int(name.rsplit("-", 1)[1]),
                    "tree": {"drafter": drafter, "policy": policy, **params,
                             "load_budget": "adaptive" if adaptive else "fixed"}}
    raise ValueError(f"unknown method {name!r}: none, ngram, suffix, vllm-eagle3-K, tree-N, tree-adaptive-N, eagle3-N, "
                     "eagle3-adaptive-N, draft-lm-N, draft-lm-adaptive-N, hybrid-N, hybrid-adaptive-N")


def with_draft_model(spec: dict | None, head: str) -> dict | None:
    """``spec`` with its draft model: the EAGLE-3 ``head`` for an EAGLE-3 head
    or the hybrid, the project's draft LM for ``draft_model``."""
    if spec is not None and (spec.get("tree", {}).get("drafter") in ("eagle3", "hybrid") or spec["method"] == "eagle3"):
        spec["model"] = head
    elif spec is not None and spec.get("tree", {}).get("drafter") == "draft_model":
        spec["model"] = engines.draft_lm_path()
    return spec


COLUMNS = {
    "forward": ["execute_model/forward"],
    "attn": ["execute_model/forward/attention"],
    "tree_attn": ["execute_model/forward/tree_attention", "execute_model/forward/attention/tree_attention"],
    "prepare": ["execute_model/prepare"],
    "verify": ["sample_tokens/verify"],
    "compact": ["sample_tokens/verify/compaction"],
    "grow": ["sample_tokens/draft/grow"],
    "dpass": ["sample_tokens/draft/draft_first_pass/draft_forward", "sample_tokens/draft/grow/draft_pass"],
    "dbook": ["sample_tokens/draft/draft_first_pass"],
    "draft_self": ["sample_tokens/draft"],
    "runner": ["execute_model", "sample_tokens"],
}


def self_times(phases: dict) -> dict[str, float]:
    """Seconds per column, each phase without the phases nested in it."""
    inclusive = {key: value[0] for key, value in phases.items()}
    own = {}
    for key, seconds in inclusive.items():
        children = [k for k in inclusive if k.startswith(key + "/") and "/" not in k[len(key) + 1:]]
        own[key] = seconds - sum(inclusive[k] for k in children)
    columns = {}
    for column, keys in COLUMNS.items():
        if column == "dpass":
            # Model drafters' passes with everything inside them.
            columns[column] = sum(inclusive.get(k, 0.0) for k in keys)
        else:
            columns[column] = sum(own.get(k, 0.0) for k in keys)
    return columns


class ProfiledEngine:
    """One engine's profiled passes, advanced one engine step at a time: a
    pass keeps ``in_flight`` of ``count`` prompts in the engine; each step's
    wall time is measured around ``LLMEngine.step``, the worker's phases by
    the adapter's timers (installed here), and for ``adaptive_tree`` the
    step is filed by what its proposal did (the plugin's counters read after
    every step, outside its timing)."""

    def __init__(self, llm, job: dict) -> None:
        from vllm import SamplingParams

        from benchmarks import phase_times

        self.llm, self.engine, self.profile = llm, llm.llm_engine, phase_times
        tokenizer = llm.get_tokenizer()
        self.prompts = [tokenizer.apply_chat_template(m, add_generation_prompt=True, tokenize=False)
                        for m in job["conversations"]]
        self.params = SamplingParams(temperature=0.0, max_tokens=job["max_tokens"],
                                     **engine_worker.sampling_options(job.get("sampling", {})))
        self.tree_method = engine_worker.is_tree_method(job)
        llm.collective_rpc(phase_times.install)

    def start(self, count: int, in_flight: int) -> None:
        self.llm.reset_prefix_cache()
        self.llm.collective_rpc(self.profile.reset)
        self.before = self.counters = engine_worker.tree_counters(self.llm, self.tree_method)
        self.phases: dict = {}
        self.by_kind: dict[str, dict] = {}
        self.waiting, self.in_flight, self.running = list(range(count)), in_flight, 0
        self.step_seconds: list[float] = []
        self.token_ids: dict[int, list[int]] = {}

    def close(self) -> None:
        """Shut the engine down and drop it, so a next group of engines in
        this process finds its memory free."""
        self.llm.llm_engine.engine_core.shutdown()
        self.llm = self.engine = None

    def busy(self) -> bool:
        return bool(self.waiting) or self.engine.has_unfinished_requests()

    def step(self) -> None:
        while self.waiting and self.running < self.in_flight:
            index = self.waiting.pop(0)
            self.engine.add_request(f"p{index}-{time.monotonic_ns()}", self.prompts[index % len(self.prompts)],
                                    self.params)
            self.running += 1
        started = time.perf_counter()
        outputs = self.engine.step()
        self.step_seconds.append(time.perf_counter() - started)
        for output in outputs:
            if output.finished:
                self.running -= 1
                self.token_ids[int(output.request_id[1:].split("-")[0])] = list(output.outputs[0].token_ids)
        if self.tree_method:
            now, now_phases = engine_worker.tree_counters(self.llm, True), self.llm.collective_rpc(self.profile.report)[0]
            kind = self.by_kind.setdefault(_kind_of_step(self.counters, now), {"steps": 0, "wall_s": 0.0, "phases": {}})
            kind["steps"] += 1
            kind["wall_s"] += self.step_seconds[-1]
            for key, (seconds, calls) in now_phases.items():
                old = self.phases.get(key, (0.0, 0))
                total = kind["phases"].setdefault(key, [0.0, 0])
                total[0] += seconds - old[0]
                total[1] += calls - old[1]
            self.counters, self.phases = now, now_phases

    def result(self) -> dict:
        after = engine_worker.tree_counters(self.llm, self.tree_method)
        return {"steps": len(self.step_seconds), "wall_s": sum(self.step_seconds),
                "tokens": sum(len(ids) for ids in self.token_ids.values()),
                "phases": self.llm.collective_rpc(self.profile.report)[0],
                "tree": {k: after[k] - self.before[k] for k in after}, "by_kind": self.by_kind,
                "token_ids": [self.token_ids[i] for i in sorted(self.token_ids)]}


def _kind_of_step(before: dict, after: dict) -> str:
    """What the step's proposal did: drafted, a probe, paused, or none asked."""
    for kind in ("probes", "paused"):
        if after[kind] > before[kind]:
            return kind.removesuffix("s")
    return "drafting" if after["drafting_steps"] > before["drafting_steps"] else "no proposal"


def _pass_size(job: dict, batch_size: int) -> int:
    return max(batch_size, job["min_prompts"])


def _profile_pass(profiled: ProfiledEngine, count: int, in_flight: int) -> dict:
    profiled.start(count, in_flight)
    while profiled.busy():
        profiled.step()
    return profiled.result()


def worker(job_path: str) -> None:
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    # The timers are installed by sending a function to the worker process
    # (collective_rpc), which vLLM only pickles with this set.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    profiled = ProfiledEngine(engine_worker.open_engine(job, max(job["batch_sizes"])), job)
    _profile_pass(profiled, 2, 2)  # warm-up
    results = []
    for batch_size in job["batch_sizes"]:
        result = _profile_pass(profiled, _pass_size(job, batch_size), batch_size)
        del result["token_ids"]
        results.append({**result, "batch_size": batch_size})
        print(f"[worker] b={batch_size}: {result['steps']} steps, {result['tokens']} tokens", flush=True)
    Path(job["result_path"]).write_text(json.dumps({"runs": results}), encoding="utf-8")


def lockstep(jobs: dict, batch_sizes: list[int], passes: int, counts: list[int] | None = None, progress=None) -> list[dict]:
    """Every method's engine in this one process, stepped in turn (one step
    each, the order rotating every step), so the machine's drift over
    minutes falls on every method alike and what is left between two
    engines is their own work (and their memory placement: compare two
    engines without speculation). ``adaptive_tree`` engines are opened
    first: the first makes vLLM's attention backend the tree-aware one for
    the rest of the process (vLLM caches its choice, so one opened after an
    engine without speculation would get the stock backend and be refused);
    the engines after them run the stock kernel behind the tree backend's
    per-layer check. vLLM's own methods open last: an engine opened after
    an ``ngram`` engine fails in vLLM's CPU kernel registration
    (``'_lib_fn_wrapper' object has no attribute 'get'``). Returns one row
    per method, batch size and pass, with greedy equality against the first
    method. ``counts``: prompts of a pass at each batch size (default: the batch size, at
    least the first job's ``min_prompts``). ``progress(rows)`` runs after every timed pass."""
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    order = sorted(jobs, key=lambda name: 0 if engine_worker.is_tree_method(jobs[name])
                   else 1 if jobs[name]["speculative_config"] is None else 2)
    profiled = {}
    for name in order:
        print(f"{name} starts", flush=True)
        profiled[name] = ProfiledEngine(engine_worker.open_engine({**jobs[name], "engine_layout": "in-process"},
                                                            max(batch_sizes)), jobs[name])
    rows = []
    counts = counts or [_pass_size(jobs[order[0]], b) for b in batch_sizes]
    for count, in_flight, timed in [(2, 2, False)] + [(n, b, True) for b, n in zip(batch_sizes, counts)
                                                        for _ in range(passes)]:
        for engine in profiled.values():
            engine.start(count, in_flight)
        turn = list(profiled)
        while any(engine.busy() for engine in profiled.values()):
            for name in turn:
                if profiled[name].busy():
                    profiled[name].step()
            turn = turn[1:] + turn[:1]
        if not timed:
            continue
        results = {name: engine.result() for name, engine in profiled.items()}
        first = results[next(iter(jobs))]
        reference = first["token_ids"]
        for name in jobs:
            result = results[name]
            same = sum(a == b for a, b in zip(result.pop("token_ids"), reference))
            ratio = (result["tokens"] / result["wall_s"]) / (first["tokens"] / first["wall_s"])
            rows.append({"method": name, "batch_size": in_flight, "ratio": ratio,
                         "same": [same, len(reference)], **result})
            print(f"[lockstep] {name} b={in_flight}: {result['steps']} steps, {result['tokens']} tokens, "
                  f"{ratio:.3f}x the first method, greedy same {same}/{len(reference)}", flush=True)
        if progress is not None:
            progress(rows)
    for engine in profiled.values():
        engine.close()
    profiled.clear()
    gc.collect()
    return rows


def graphs(phases: dict, prefix: str = GRAPH_KEY) -> str:
    """The CUDA graph runtime modes the steps' forwards (``prefix``: the
    target's, or a model drafter's passes) were dispatched to, as ``FULL n /
    PIECEWISE n / NONE n`` (the modes that occurred)."""
    counts = {key.removeprefix(prefix): value[1] for key, value in phases.items() if key.startswith(prefix)}
    return " / ".join(f"{mode} {counts[mode]}" for mode in ("FULL", "PIECEWISE", "NONE") if counts.get(mode))


def table(report: dict) -> str:
    head = ["method", "b", "tok/s", "vs first", "same", "tok/step", "ms/step", *COLUMNS, "engine", "leaf", "overlap <=",
            "graphs", "draft graphs"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in report["rows"]:
        if "error" in row:
            lines.append(f"| {row['method']} | {row['batch_size']} | {row['error']} |")
            continue
        steps = row["steps"]
        cols = self_times(row["phases"])
        worker_s = sum(cols.values())
        cells = [row["method"], str(row["batch_size"]), f"{row['tokens'] / row['wall_s']:.1f}",
                 f"{row['ratio']:.3f}" if "ratio" in row else "",
                 "{}/{}".format(*row["same"]) if "same" in row else "",
                 f"{row['tokens'] / steps:.2f}", f"{1000 * row['wall_s'] / steps:.1f}"]
        cells += [f"{1000 * cols[c] / steps:.2f}" for c in COLUMNS]
        cells.append(f"{1000 * (row['wall_s'] - worker_s) / steps:.2f}")
        tree = row.get("tree") or {}
        if tree.get("trees_verified"):
            leaf = tree["leaf_paths"] / tree["trees_verified"]
            drafting = sum(cols[c] for c in ("grow", "dpass", "dbook", "draft_self"))
            cells += [f"{leaf:.0%}", f"{leaf * drafting / row['wall_s']:.1%}"]
        else:
            cells += ["", ""]
        cells += [graphs(row["phases"]), graphs(row["phases"], DRAFT_GRAPH_KEY)]
        lines.append("| " + " | ".join(cells) + " |")
        for kind, part in (row.get("by_kind") or {}).items():
            cols = self_times(part["phases"])
            cells = [f"{row['method']} [{kind}]", str(row["batch_size"]), "", "", "", f"{part['steps']} steps",
                     f"{1000 * part['wall_s'] / part['steps']:.1f}"]
            cells += [f"{1000 * cols[c] / part['steps']:.2f}" for c in COLUMNS]
            cells += [f"{1000 * (part['wall_s'] - sum(cols.values())) / part['steps']:.2f}", "", "",
                      graphs(part["phases"]), graphs(part["phases"], DRAFT_GRAPH_KEY)]
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none,ngram,tree-0,tree-1,tree-4,tree-16,tree-60,tree-adaptive-16")
    add_batches(parser, "1,8,64")
    add_workload(parser, max_tokens=32, prompts=None)
    add_sampling(parser)
    parser.add_argument("--min-prompts", type=int, default=4, help="prompts per pass at least (b=1 runs them in turn)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default): on CPUs without native bf16 (AVX2 only), bf16 matmuls cost "
                             "the same per row whatever the batch, so no speculation can pay there")
    parser.add_argument("--engine-layout", choices=("processes", "in-process", "lockstep"), default="processes",
                        help="as in benchmarks/throughput.py: vLLM's processes, or engine and worker in one "
                             "process, one method after another; lockstep: every method's engine in this process, "
                             "stepped in turn (ratios between methods without the machine's drift)")
    parser.add_argument("--passes", type=int, default=2, help="lockstep: timed passes per batch size")
    parser.add_argument("--head", default=str(engines.HEAD), help="EAGLE-3 head (eagle3-N)")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds per engine process")
    add_output(parser)
    parser.add_argument("--worker", help=argparse.SUPPRESS)
    return parser


def _jobs(args, model: str, conversations: list) -> dict[str, dict]:
    """Every listed method's engine job (a method listed twice runs twice, as ``NAME #2``)."""
    jobs, listed = {}, Counter()
    for method in args.methods.split(","):
        spec = with_draft_model(method_config(method), args.head)
        listed[method] += 1
        name = method if listed[method] == 1 else f"{method} #{listed[method]}"
        jobs[name] = {"model": model, "dtype": args.dtype, "speculative_config": spec,
                      "batch_sizes": args.batch_sizes, "max_tokens": args.max_tokens, "min_prompts": args.min_prompts,
                      "max_model_len": engines.needed_model_len(model, conversations, args.max_tokens),
                      "conversations": conversations, "engine_layout": args.engine_layout, "sampling": args.sampling,
                      "runner": engine_worker.V1_SYNC if method == "none-v1-sync" else None}
    return jobs


def _one_after_another(args, jobs: dict[str, dict], progress) -> list[dict]:
    """Each method's engine in a worker process of its own, in turn: its rows
    (``progress(rows)`` after each)."""
    rows, suffix_dir = [], None
    for name, job in jobs.items():
        print(f"{name} ...", flush=True)
        if name.startswith("suffix") and suffix_dir is None:
            suffix_dir, suffix_error = engines.suffix_decoding_dir()
            if suffix_error:
                raise SystemExit(f"step_profile.py: suffix: {suffix_error}")
        result = engines.run_engine(job, args.out, f"profile-{name.replace(' #', '-')}", args.worker_timeout,
                                    env=engines.suffix_env(suffix_dir) if name.startswith("suffix") else None,
                                    script=Path(__file__).resolve())
        if "error" in result:
            rows += [{"method": name, "batch_size": b, "error": f"{result['error']}, see {result['log']}"}
                     for b in args.batch_sizes]
            continue
        rows += [{"method": name, **r} for r in result["runs"]]
        progress(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    args = _parser().parse_args(argv)
    if args.worker:
        worker(args.worker)
        return

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    model = str(ensure_demo_model())
    conversations = [p.messages for p in engines.interleave_categories(load_prompts(args.prompts))]
    conversations = conversations[: max(max(args.batch_sizes), args.min_prompts)]
    args.out.mkdir(parents=True, exist_ok=True)
    jobs = _jobs(args, model, conversations)

    def keep(rows: list[dict]) -> None:  # the report so far: a run cut short keeps what it measured
        report = {"settings": vars(args), "rows": rows}
        write_report(args.out, "step_profile", report, table(report))

    if args.engine_layout == "lockstep":
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
        keep(lockstep(jobs, args.batch_sizes, args.passes, progress=keep))
    else:
        keep(_one_after_another(args, jobs, keep))


if __name__ == "__main__":
    main()
