"""Offline throughput of speculative decoding methods on the demo model (vLLM CPU or GPU).

Per batch size and method, on the same workload (the project's prompts, or
``--prompts``, round-robin over categories, ``--max-tokens`` each, at most b
requests in flight): tok/s of a timed pass and its ratio to ``none``; tau
(``1 + accepted / drafts``) and verified nodes per drafting step from vLLM's
spec-decode counters; for ``adaptive_tree``, the plugin's draft passes and
drafting share; and whether each prompt's greedy token ids equal ``none``'s
("same as none"; use ``--dtype float32`` for an exact-output check).
``--engine-per interleaved`` alternates every method's passes in rounds and
reports the median of the per-round ratios (``benchmarks/engines.py``); use it
for anything you will compare. ``docs/benchmarking.md`` describes every method
and option and how to read the table.

Reproduce (from the repository root)::

    # the default run: b = 1,4,16,64; none, ngram, tree-retrieval, tree-retrieval-fixed (10 min on 2 CPU cores)
    .venv/bin/vllm-adaptive-spec bench throughput
    # smoke run: b = 1,4; 8 prompts; 32 tokens (about 4-5 min for three methods)
    .venv/bin/vllm-adaptive-spec bench throughput --quick --methods none,ngram,tree-retrieval
    # the comparison the README quotes: interleaved rounds
    .venv/bin/vllm-adaptive-spec bench throughput --engine-layout in-process --engine-per interleaved --rounds 2 \
        --methods none,ngram,tree-retrieval --batch-sizes 1,8

Outputs: ``throughput.json`` (every number, the settings, vLLM version,
machine, timestamp), ``throughput.md`` (the table, also printed) and, with
matplotlib, ``throughput.png`` (ratio against batch size) in ``--out``.
Add a method: one line in ``METHODS`` (name -> function of the parsed
arguments returning the ``speculative_config``, or None for no speculation);
or run a config of your own beside them, ``--spec LABEL='{...}'``.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import engine_worker, engines
from benchmarks.options import REPO, add_batches, add_output, add_sampling, add_workload, parse_spec
from benchmarks.report import checkout_commit, compare, fmt, installed_vllm_version, machine, machine_line, pyplot, save_ratio_plot, write_report


def _tree(args, drafter: str, policy: str, nodes: int | None = None, model: str | None = None, **params) -> dict:
    spec = {
        "method": "adaptive_tree",
        "num_speculative_tokens": nodes or args.nodes,
        "tree": {"drafter": drafter, "policy": policy, **params},
    }
    if model is not None:
        spec["model"] = model
    return spec


def _head(args) -> str:
    return args.head


def _draft_lm(args) -> str:
    return args.draft_lm or engines.draft_lm_path()


# name -> speculative_config (None: no speculation). One line per method.
METHODS = {
    "none": lambda args: None,
    "none-v1-sync": lambda args: None,  # on the plugin's runner and scheduling (RUNNERS)
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
    # The retrieval drafter's two matchers side by side (``auto``: the trie, until the tensors measure faster).
    "tree-retrieval-trie": lambda args: _tree(args, "retrieval", "retrieval", matcher="trie"),
    "tree-retrieval-tensors": lambda args: _tree(args, "retrieval", "retrieval", matcher="tensors"),
    # The retrieval drafter's default evidence_prior before 4.0, for side-by-side runs.
    "tree-retrieval-prior2": lambda args: _tree(args, "retrieval", "retrieval", evidence_prior=2.0),
    "eagle3": lambda args: {"method": "eagle3", "model": _head(args), "num_speculative_tokens": args.chain_k},
    "chain-eagle3": lambda args: _tree(args, "eagle3", "chain", args.chain_k, _head(args)),
    "tree-eagle3": lambda args: _tree(args, "eagle3", "eagle2", args.tree_nodes, _head(args)),
    "c2t-eagle3": lambda args: _tree(args, "eagle3", "c2t", args.tree_nodes, _head(args)),
    "tree-hybrid": lambda args: _tree(args, "hybrid", "eagle2", args.tree_nodes, _head(args)),
    # The hybrid on the device's path: the tensor matcher (its layers at fixed capacity where steps are uniform).
    "tree-hybrid-tensors": lambda args: _tree(args, "hybrid", "eagle2", args.tree_nodes, _head(args),
                                              matcher="tensors"),
    "chain-draft-lm": lambda args: _tree(args, "draft_model", "chain", args.chain_k, _draft_lm(args)),
    "tree-draft-lm": lambda args: _tree(args, "draft_model", "eagle2", args.tree_nodes, _draft_lm(args)),
    "suffix": lambda args: dict(engines.SUFFIX),
}
RUNNERS = {"none-v1-sync": engine_worker.V1_SYNC}  # methods on another runner than vLLM's default
BASELINE = "none"
# The default run stays within 15 minutes on 2 CPU cores.
DEFAULT_METHODS = ("none", "ngram", "tree-retrieval", "tree-retrieval-fixed")

DEFAULTS = dict(batch_sizes=[1, 4, 16, 64], num_prompts="auto", max_tokens=64)
QUICK = dict(batch_sizes=[1, 4], num_prompts="8", max_tokens=32)
# --num-prompts auto: at batch size b, min(set size, max(AUTO_MIN_PROMPTS, AUTO_WAVES * b)) prompts.
AUTO_MIN_PROMPTS, AUTO_WAVES = 8, 2


def workload_sizes(batch_sizes: list[int], num_prompts: str, available: int) -> dict[int, int]:
    """Prompts per batch size: ``--num-prompts N`` for every b, or the ``auto`` rule."""
    if num_prompts == "auto":
        return {b: min(available, max(AUTO_MIN_PROMPTS, AUTO_WAVES * b)) for b in batch_sizes}
    return {b: min(available, int(num_prompts)) for b in batch_sizes}


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
    """The engine worker; a ``suffix`` engine's response cache is emptied
    before every timed pass, as the prefix cache is (every pass replays
    prompts the engine has answered)."""
    job = json.loads(Path(job_path).read_text(encoding="utf-8"))
    if (job["speculative_config"] or {}).get("method") != "suffix":
        engine_worker.worker(job_path)
        return
    # _reset_suffix_cache is sent to the engine process, which vLLM only pickles with this set.
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"

    def empty_suffix_cache(llm) -> None:
        dropped = llm.collective_rpc(_reset_suffix_cache)[0]
        print(f"[worker] suffix decoding cache emptied ({dropped} cached responses)", flush=True)

    engine_worker.worker(job_path, empty_suffix_cache)


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Throughput",
        "",
        f"prompts per pass: {s['num_prompts']} ({s['prompt_order']}), temperature={s['temperature']}, "
        f"max_tokens={s['max_tokens']}, dtype={s['dtype']}, retrieval N={s['nodes']}, ngram K={s['ngram_k']}, "
        f"chain K={s['chain_k']}, eagle2 N={s['tree_nodes']}, engine per {s['engine_per']}, "
        f"engine layout {s.get('engine_layout', 'processes')}; "
        f"vLLM {report['vllm_version']}, {machine_line(report['machine'])}; {report['timestamp']}",
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
    lines += [_result_line(row) for row in report["results"]]
    errors = [row for row in report["results"] if "error" in row]
    if errors:
        lines += ["", "Errors:"]
        lines += [f"- b={row['batch_size']} {row['method']}: {row['error']}" for row in errors]
    lines += _category_lines([row for row in report["results"] if row.get("by_category")])
    lines += ["", f"Total elapsed: {report['elapsed_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def _result_line(row: dict) -> str:
    if "error" in row:
        return f"| {row['batch_size']} | {row['num_prompts']} | {row['method']} | error | | | | | |"
    same = row.get("same_as_none")
    ratio = fmt(row.get("ratio_vs_none"), ".2f")
    if len(row.get("ratio_per_round", ())) > 1:
        ratio += f" ({min(row['ratio_per_round']):.2f}-{max(row['ratio_per_round']):.2f})"
    return (f"| {row['batch_size']} | {row['num_prompts']} | {row['method']} | {row['tok_per_s']:.1f} | "
            f"{ratio} | {fmt(row['tau'], '.2f')} | {fmt(row['verified_per_step'], '.2f')} | "
            f"{fmt(row.get('drafting_share'), '.0%')} | {'n/a' if same is None else f'{same[0]}/{same[1]}'} |")


def _category_lines(categorised: list[dict]) -> list[str]:
    """tau by prompt category, where the passes were timed by category."""
    if not categorised:
        return []
    names = list(categorised[0]["by_category"])
    lines = ["", "tau by prompt category (one timed pass per category):", "",
             "| batch | method | " + " | ".join(names) + " |", "|---:|---|" + "---:|" * len(names)]
    for row in categorised:
        specs = [row["by_category"].get(name, {}).get("spec", {}) for name in names]
        cells = [fmt(1 + spec["accepted_tokens"] / spec["drafts"] if spec.get("drafts") else None, ".2f")
                 for spec in specs]
        lines.append(f"| {row['batch_size']} | {row['method']} | " + " | ".join(cells) + " |")
    return lines


def plot(report: dict, out: Path) -> list[Path]:
    """Each method's tok/s over no speculation's against the batch size, with
    the rounds' range (none without matplotlib: ``pip install -e .[bench]``)."""
    plt = pyplot()
    if plt is None:
        return []
    rows = [r for r in report["results"] if r.get("ratio_vs_none") is not None]
    batch_sizes = sorted({r["batch_size"] for r in rows})
    fig, ax = plt.subplots(figsize=(6.4, 3.6))
    for method in dict.fromkeys(r["method"] for r in rows):
        mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["batch_size"])
        x = [batch_sizes.index(r["batch_size"]) for r in mine]
        y = [r["ratio_vs_none"] for r in mine]
        spread = [[v - min(r.get("ratio_per_round", [v])) for v, r in zip(y, mine)],
                  [max(r.get("ratio_per_round", [v])) - v for v, r in zip(y, mine)]]
        ax.errorbar(x, y, yerr=spread, marker="o", capsize=3, label=method)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(batch_sizes)), [str(b) for b in batch_sizes])
    ax.set_xlabel("batch size")
    save_ratio_plot(plt, fig, ax, out / "throughput.png")
    return [out / "throughput.png"]


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma list of {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)})",
    )
    parser.add_argument("--spec", type=parse_spec, action="append", default=[], metavar="LABEL=JSON",
                        help="a speculative config of your own, run beside --methods under LABEL (repeatable)")
    add_batches(parser, None)
    parser.add_argument("--num-prompts", help="prompts per pass: N, or auto = min(70, max(8, 2 * batch size)) (default auto)")
    add_workload(parser, max_tokens=None, prompts=None)
    add_sampling(parser)
    parser.add_argument("--quick", action="store_true", help="smoke run: batch sizes 1,4; 8 prompts; 32 tokens")
    parser.add_argument("--prompt-order", choices=("interleaved", "file"), default="interleaved",
                        help="take prompts round-robin over categories (default) or in file order")
    parser.add_argument("--nodes", "--budget", type=int, default=16, help="N of adaptive_tree (num_speculative_tokens)")
    parser.add_argument("--ngram-k", type=int, default=4, help="ngram num_speculative_tokens")
    parser.add_argument("--chain-k", type=int, default=4, help="chain depth of eagle3 (vLLM's) and the chain-* methods")
    parser.add_argument("--tree-nodes", "--tree-budget", type=int, default=60, help="N of the eagle2 trees (K=10, D=8)")
    parser.add_argument("--head", default=str(engines.HEAD), help="EAGLE-3 head directory")
    parser.add_argument("--draft-lm", help="draft LM directory (default: `vllm-adaptive-spec draft-lm`'s, built if missing)")
    parser.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (engine seed 0)")
    parser.add_argument("--by-category", action="store_true",
                        help="time each prompt category in its own pass and report tau per category")
    _add_engine_options(parser)
    add_output(parser)
    parser.add_argument("--worker", metavar="JOB_JSON", help=argparse.SUPPRESS)
    return parser


def _add_engine_options(parser: argparse.ArgumentParser) -> None:
    """How the engines are laid out, started and sized."""
    parser.add_argument("--engine-per", choices=("method", "run", "interleaved"), default="method",
                        help="one engine per method for all batch sizes (default), or per (batch size, method); "
                             "interleaved: every method's engine stays up and their passes alternate, in "
                             "--rounds rounds per batch size (all engines are in memory at once: about 4 GiB "
                             "each at batch 64 in float32)")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved: timed passes per method and batch size")
    parser.add_argument("--start-together", action="store_true",
                        help="interleaved: start every engine at once rather than one by one (a GPU machine's "
                             "cores and memory hold them; startup is not timed)")
    parser.add_argument("--warmup-prompts", type=int, default=2, help="prompts in each engine's warm-up pass")
    parser.add_argument("--model", help="model directory (default: the demo model)")
    parser.add_argument("--dtype", default="float32",
                        help="float32 (default): on CPUs without native bf16 (AVX2 only), bf16 matmuls cost "
                             "the same per row whatever the batch, so no speculation can pay there")
    parser.add_argument("--engine-layout", choices=("processes", "in-process"), default="processes",
                        help="processes (default): vLLM's own layout (an EngineCore process and a worker "
                             "process); in-process: both in the benchmark's worker process. On a 2-core "
                             "machine the processes' polling adds 20-40 ms to every step")
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="0 (default): the longest prompt plus --max-tokens plus 128, rounded up to 128; "
                             "the KV cache is sized for max_num_seqs requests of this length")
    parser.add_argument("--worker-timeout", type=float, default=1800, help="seconds per engine process")


def _methods(parser: argparse.ArgumentParser, args) -> tuple[list[str], dict[str, dict]]:
    """The methods run (``--methods``, then the ``--spec`` labels) and every one's speculative config."""
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(METHODS)}")
    own = dict(args.spec)
    if set(own) & set(methods) or len(own) < len(args.spec):
        parser.error("--spec labels must differ from each other and from --methods")
    methods += list(own)
    return methods, {m: own[m] if m in own else METHODS[m](args) for m in methods}


class _Plan:
    """The engines' jobs: every method's config on the workload's prompts."""

    def __init__(self, args, model: str, prompts: list, sizes_by_batch: dict[int, int], configs: dict) -> None:
        self.sizes_by_batch, self.configs = sizes_by_batch, configs
        self.base_job = {
            "model": model, "dtype": args.dtype, "max_model_len": args.max_model_len, "max_tokens": args.max_tokens,
            "warmup_prompts": args.warmup_prompts, "conversations": [p.messages for p in prompts],
            "categories": [p.category for p in prompts], "by_category": args.by_category,
            "temperature": args.temperature, "engine_layout": args.engine_layout, "sampling": args.sampling,
        }

    def job(self, method: str, sizes: list[int], max_num_seqs: int) -> dict:
        return {**self.base_job, "speculative_config": self.configs[method], "runner": RUNNERS.get(method),
                "batch_sizes": sizes, "num_prompts": [self.sizes_by_batch[b] for b in sizes],
                "max_num_seqs": max_num_seqs}


def _run_engines(args, methods: list[str], plan: _Plan, work: Path, log, keep) -> tuple[list[tuple], str | None]:
    """Every method's engine run as ``--engine-per`` lays them out: (method, batch sizes, max_num_seqs,
    its result) each, and the suffix build's directory (vLLM's suffix method imports
    arctic_inference.suffix_decoding, built here on demand); ``keep(results, suffix_dir)`` after each
    batch size (interleaved) or engine."""
    batch_sizes, results = args.batch_sizes, []
    suffix_dir = suffix_error = None
    if "suffix" in methods:
        log(f"suffix: building Arctic Inference's suffix tree ({engines.SUFFIX_BUILD_SCRIPT.relative_to(REPO)})")
        suffix_dir, suffix_error = engines.suffix_decoding_dir()
        print(f"  {suffix_error or suffix_dir}", flush=True)
        if suffix_error is not None:
            results.append(("suffix", batch_sizes, max(batch_sizes), {"runs": [], "error": suffix_error}))

    def env_for(method: str) -> dict | None:
        return engines.suffix_env(suffix_dir) if method == "suffix" else None

    script = Path(__file__).resolve()
    runnable = [m for m in methods if not (m == "suffix" and suffix_error is not None)]
    planned = {m: plan.job(m, batch_sizes, max(batch_sizes)) for m in runnable}
    problem = engines.memory_problem(planned, args.engine_per == "interleaved", engines.available_memory())
    if problem:
        raise SystemExit(f"throughput.py: {problem}")
    if args.engine_per == "interleaved":
        finished = lambda done: results + [(m, batch_sizes, max(batch_sizes), done[m]) for m in runnable if m in done]
        done = engines.run_interleaved(planned, work, args.rounds, args.worker_timeout, env_for, log, lambda name: script,
                                       start_together=args.start_together,
                                       progress=lambda done: keep(finished(done), suffix_dir))
        return finished(done), suffix_dir
    layout = ([(m, batch_sizes, max(batch_sizes)) for m in runnable] if args.engine_per == "method"
              else [(m, [b], b) for b in batch_sizes for m in runnable])
    for index, (method, sizes, max_num_seqs) in enumerate(layout, 1):
        log(f"engine {index}/{len(layout)}: {method}, batch sizes {sizes}")
        result = engines.run_engine(plan.job(method, sizes, max_num_seqs), work,
                                    f"{method}-b{'_'.join(map(str, sizes))}", args.worker_timeout,
                                    env_for(method), script)
        for run in result["runs"]:
            print(f"  b={run['batch_size']}: {run['tok_per_s']:.1f} tok/s ({run['wall_s']:.1f} s)", flush=True)
        results.append((method, sizes, max_num_seqs, result))
        keep(results, suffix_dir)
    return results, suffix_dir


def _rows(results: list[tuple], methods: list[str], plan: _Plan, batch_sizes: list[int], prompt_ids: list[str]):
    """Each (batch size, method)'s row against no speculation, and each engine's record."""
    runs: dict[tuple[str, int], list[dict]] = {}
    errors: dict[tuple[str, int], str] = {}
    engine_records = []
    for method, sizes, max_num_seqs, result in results:
        for run in result["runs"]:
            runs.setdefault((method, run["batch_size"]), []).append(run)
        if "error" in result:
            print(f"  {method} FAILED: {result['error']}; log: {result.get('log')}", flush=True)
            errors.update({(method, b): result["error"] for b in sizes if (method, b) not in runs})
        engine_records.append({"method": method, "batch_sizes": sizes, "max_num_seqs": max_num_seqs,
                               **{k: v for k, v in result.items() if k != "runs"}})
    rows = []
    for b in batch_sizes:
        base = runs.get((BASELINE, b))
        for method in methods:
            row = compare(method, plan.configs[method] is not None, runs.get((method, b)),
                          base if method != BASELINE else None, errors.get((method, b)), prompt_ids)
            rows.append({**row, "batch_size": b, "num_prompts": plan.sizes_by_batch[b]})
    return rows, engine_records


def _settings(args, methods: list[str], plan: _Plan, prompts: list, model: str, suffix_dir: str | None) -> dict:
    return {
        "methods": {m: plan.configs[m] for m in methods}, "batch_sizes": args.batch_sizes,
        "num_prompts": args.num_prompts,
        "prompts_per_batch_size": {str(b): n for b, n in plan.sizes_by_batch.items()},
        "prompts": str(args.prompts or ""), "prompt_order": args.prompt_order, "prompt_ids": [p.id for p in prompts],
        "max_tokens": args.max_tokens, "temperature": args.temperature, "by_category": args.by_category,
        "sampling": args.sampling,
        "chain_k": args.chain_k, "tree_nodes": args.tree_nodes, "ignore_eos": False, "dtype": args.dtype,
        "engine_layout": args.engine_layout, "max_model_len": args.max_model_len, "nodes": args.nodes,
        "ngram_k": args.ngram_k, "engine_per": args.engine_per,
        "rounds": args.rounds if args.engine_per == "interleaved" else 1,
        "warmup_prompts": args.warmup_prompts, "model": model, "quick": args.quick,
        **({"suffix_decoding_dir": suffix_dir} if "suffix" in methods else {}),
    }


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker)
        return
    for key, value in (QUICK if args.quick else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    methods, configs = _methods(parser, args)
    if args.num_prompts != "auto" and not (args.num_prompts.isdigit() and int(args.num_prompts) > 0):
        parser.error("--num-prompts must be a positive integer or auto")

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    model = args.model or str(ensure_demo_model())
    prompts = load_prompts(args.prompts)
    if args.prompt_order == "interleaved":
        prompts = engines.interleave_categories(prompts)
    sizes_by_batch = workload_sizes(args.batch_sizes, args.num_prompts, len(prompts))
    # Warm-up prompts come from the end of the order; they may overlap the workload
    # (the prefix cache is reset before every timed pass).
    prompts = prompts[: max(max(sizes_by_batch.values()), args.warmup_prompts)]
    work = args.out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    if not args.max_model_len:
        args.max_model_len = engines.needed_model_len(model, [p.messages for p in prompts], args.max_tokens)
    plan = _Plan(args, model, prompts, sizes_by_batch, configs)
    commit = checkout_commit()

    def keep(results: list[tuple], suffix_dir: str | None, final: bool = False) -> None:
        # The report so far, written whole (a run cut short keeps what it measured); the plot at the end.
        rows, engine_records = _rows(results, methods, plan, args.batch_sizes, [p.id for p in prompts])
        versions = [r.get("vllm_version") for *_, r in results if r.get("vllm_version")]
        report = {"timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"), "commit": commit,
                  "vllm_version": versions[0] if versions else installed_vllm_version(), "machine": machine(),
                  "settings": _settings(args, methods, plan, prompts, model, suffix_dir), "engines": engine_records,
                  "results": rows, "elapsed_s": time.perf_counter() - t0, **({} if final else {"partial": True})}
        write_report(args.out, "throughput", report, markdown(report), plot if final else None)

    keep(*_run_engines(args, methods, plan, work, log, keep), final=True)


if __name__ == "__main__":
    main()
