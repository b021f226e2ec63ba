"""A change to the engine path, before and after, in one interleaved run:
no speculation, vLLM's own methods (``--vllm-methods``: ``ngram`` with K = 4
by default, also ``suffix`` and ``eagle3`` with the project's head, K = 4, as
``benchmarks/throughput.py`` runs them; each once, by the ``--after``
checkout), and each ``--spec`` config run twice, by the code of
``--before`` and by the code of ``--after`` (two checkouts, e.g. ``git
worktree add --detach ../before REV``), every engine up at once and taking
turns (``benchmarks/engines.py``), so both sides see the same drift of the
machine. Each engine runs its checkout's own
``benchmarks/engines.py``, with that checkout first on ``PYTHONPATH``.

Per batch size and config: the ratio to no speculation (median of the
rounds, and each round's), tau, the plugin's counters and greedy equality
with no speculation. ``--sampling`` adds sampling parameters to every greedy
request (penalties, structured output), as in ``bench throughput``. Outputs
in ``--out``: ``before_after.json`` and ``before_after.md``.

Reproduce (the project's default config, the held-out prompts)::

    git worktree add --detach ../before HEAD~1
    .venv/bin/vllm-adaptive-spec bench before-after --before ../before --after . \\
        --spec retrieval='{"method": "adaptive_tree", "num_speculative_tokens": 16, "tree": {"drafter": "retrieval"}}'
"""

from __future__ import annotations

import argparse
import json
import subprocess
from pathlib import Path

from benchmarks import engines, throughput
from benchmarks.options import REPO, add_batches, add_output, add_sampling, add_workload, check_batches, parse_spec
from benchmarks.report import compare, fmt, installed_vllm_version, machine, machine_line, write_report


VLLM_METHODS = ("ngram", "suffix", "eagle3")

def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Before and after", "",
        f"before {s['before_rev']}, after {s['after_rev']}; prompts {Path(s['prompts']).name}, greedy"
        f"{' with ' + json.dumps(s['sampling']) if s.get('sampling') else ''}, "
        f"max_tokens={s['max_tokens']}, rounds={s['rounds']}; vLLM {report['vllm_version']}, "
        f"{machine_line(report['machine'])}", "",
        "| b | method | ratio to none (rounds) | tau | same as none |",
        "|---:|---|---|---:|---:|",
    ]
    for r in report["rows"]:
        rounds = ", ".join(fmt(x) for x in r.get("ratio_per_round") or [])
        same = r.get("same_as_none") or [0, 0]
        cell = "error: " + r["error"] if r.get("error") else f"{fmt(r.get('ratio_vs_none'))}x ({rounds})"
        lines.append(f"| {r['batch_size']} | {r['method']} | {cell} | {fmt(r.get('tau'))} | {same[0]}/{same[1]} |")
    return "\n".join(lines) + "\n"


def git_rev(tree: Path) -> str:
    """The checkout's commit, as recorded in the report."""
    done = subprocess.run(["git", "-C", str(tree), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else "unknown"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="checkout of the code before the change")
    parser.add_argument("--after", type=Path, default=REPO, help="checkout of the code after (default: this one)")
    parser.add_argument("--spec", type=parse_spec, action="append", required=True,
                        help="LABEL=JSON, a speculative config (repeatable); a 'model' key is replaced by the head")
    parser.add_argument("--vllm-methods", default="ngram",
                        help=f"vLLM's own methods run beside (comma list of {', '.join(VLLM_METHODS)}; '' for none)")
    add_batches(parser, "1,8,32", prompts_per_batch="2,16,64")
    add_workload(parser, max_tokens=256)
    add_sampling(parser)
    add_output(parser, "before_after")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--head", default=str(engines.HEAD))
    parser.add_argument("--worker-timeout", type=float, default=3600)
    return parser


def _engine_scripts(parser: argparse.ArgumentParser, args) -> dict[str, Path]:
    """Each side's ``benchmarks/engines.py``."""
    scripts = {}
    for side in ("before", "after"):
        script = getattr(args, side).resolve() / "benchmarks" / "engines.py"
        if not script.is_file():
            parser.error(f"--{side} {getattr(args, side)}: no benchmarks/engines.py there (not a checkout of this project)")
        scripts[side] = script
    return scripts


def _jobs(args, base_job: dict, vllm_methods: list[str], scripts: dict[str, Path]) -> tuple[dict, dict]:
    """Every engine's job and script: no speculation and vLLM's methods by
    the after checkout (vLLM's through its throughput worker, which empties
    suffix's cache per pass), each ``--spec`` by both."""
    jobs = {"none": {**base_job, "speculative_config": None}}
    script_of = {"none": scripts["after"]}
    settings = argparse.Namespace(ngram_k=4, chain_k=4, head=args.head)
    for method in vllm_methods:
        jobs[method] = {**base_job, "speculative_config": throughput.METHODS[method](settings)}
        script_of[method] = scripts["after"].with_name("throughput.py")
    for label, spec in args.spec:
        if "model" in spec:
            spec = {**spec, "model": args.head}
        for side in ("before", "after"):
            jobs[f"{label}-{side}"] = {**base_job, "speculative_config": spec}
            script_of[f"{label}-{side}"] = scripts[side]
    return jobs, script_of


def _rows(results: dict, names: list[str], batch_sizes: list[int], prompt_ids: list[str]) -> list[dict]:
    """Each (batch size, engine)'s row against no speculation."""
    rows = []
    for b in batch_sizes:
        base = [run for run in results["none"]["runs"] if run["batch_size"] == b]
        for name in names:
            passes = [run for run in results[name]["runs"] if run["batch_size"] == b]
            row = compare(name, True, passes, base, results[name].get("error"), prompt_ids)
            row.pop("token_ids", None)
            rows.append({"batch_size": b, **row})
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    vllm_methods = [m for m in args.vllm_methods.split(",") if m]
    unknown = sorted(set(vllm_methods) - set(VLLM_METHODS))
    if unknown:
        parser.error(f"--vllm-methods: unknown {', '.join(unknown)}; valid: {', '.join(VLLM_METHODS)}")
    check_batches(parser, args)
    scripts = _engine_scripts(parser, args)
    env = None
    if "suffix" in vllm_methods:
        suffix_dir, suffix_error = engines.suffix_decoding_dir()
        if suffix_error is not None:
            parser.error(f"--vllm-methods suffix: {suffix_error}")
        env = engines.suffix_env(suffix_dir)

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    base_job, prompts = engines.greedy_job(str(ensure_demo_model()),
                                           engines.interleave_categories(load_prompts(args.prompts)),
                                           "float32", args.max_tokens, args.batch_sizes, args.prompts_per_batch)
    base_job["sampling"] = args.sampling
    jobs, script_of = _jobs(args, base_job, vllm_methods, scripts)
    args.out.mkdir(parents=True, exist_ok=True)
    results = engines.run_interleaved(jobs, args.out / "logs", args.rounds, args.worker_timeout,
                                      env_for=lambda name: env if name == "suffix" else None,
                                      script_for=script_of.get)
    report = {
        "vllm_version": installed_vllm_version(), "machine": machine(),
        "settings": {
            "before_rev": git_rev(args.before), "after_rev": git_rev(args.after), "specs": dict(args.spec),
            "vllm_methods": {m: jobs[m]["speculative_config"] for m in vllm_methods},
            "batch_sizes": args.batch_sizes, "prompts_per_batch": args.prompts_per_batch,
            "max_tokens": args.max_tokens, "rounds": args.rounds, "prompts": str(args.prompts),
            "sampling": args.sampling},
        "rows": _rows(results, list(jobs)[1:], args.batch_sizes, [p.id for p in prompts]),
    }
    write_report(args.out, "before_after", report, markdown(report))


if __name__ == "__main__":
    main()
