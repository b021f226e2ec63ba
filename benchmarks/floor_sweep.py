"""The load budget's floor, for every configuration a user can write: each
drafter with each policy it offers, at several N (nodes per tree) and depth
settings, under the default load budget (``load_budget: adaptive``), against
no speculation in the same run.

Cells: ``retrieval`` with ``retrieval`` and ``chain``; ``eagle3``,
``draft_model`` and ``hybrid`` with ``chain``, ``eagle2`` (depth 8, the
default, and 18), ``talon`` (``max_depth`` 32, its default), ``deagle``
(``depth`` 18, its default), ``dynatree`` and ``c2t`` (``max_depth`` 10, its
default); every one at N = ``--nodes``. The depths are each policy's
default and the largest the project documents. ``draft_model`` with ``c2t``
takes the EAGLE-3 head's classifier (``tree.classifier``): the draft LM has
none of its own, and without one the configuration is refused at startup.
The floors: a model drafter or the hybrid at least ``0.95`` of no
speculation's tok/s, the retrieval drafter at least ``0.97``, with greedy
text equal to no speculation's.

Workload: the held-out prompt set (``benchmarks/data/heldout_prompts.jsonl``,
never used to tune anything), greedy, answers of natural length (``--max-tokens``
256), at batch 1, 8 and 64 (``--batch-sizes``; ``--prompts-per-batch`` each).
Cells run in groups of ``--group-size`` engines plus a ``none`` engine,
interleaved in ``--rounds`` rounds (``benchmarks/engines.py``), so each cell's
ratio is against no speculation measured minutes apart at most. Every group
also runs a second ``none`` engine, the *control*, whose ratio to the first
is the group's noise floor: on a 2-core machine two engine processes doing
the same work differ by several percent for their whole lives (memory
placement), so a cell's ratio is read against its group's control.
``--engine-layout lockstep`` instead opens a group's engines in this one
process and steps them in turn, one engine step each
(``benchmarks/step_profile.py``'s lockstep; a round is then a pass of every
engine at a batch size, its ratio over the same span of time as none's), so
the machine's drift over minutes falls on every engine alike; about 4 GiB
an engine at batch 64 (a draft LM's more), so on a 24 GiB machine a group of
3 EAGLE-3 or retrieval cells and two ``none``, and groups of 2 with a draft LM.

Per cell and batch size: the ratio (median of the rounds'), the share of
drafting steps that verified a tree ("verified": trees / drafting request
steps), the probe steps and draft passes, and greedy equality. Outputs in
``--out``: ``floor_sweep.json``, ``floor_sweep.md`` and, with matplotlib
(``pip install -e .[bench]``), ``floor_sweep.png`` (every cell's ratio per
batch size, the floors drawn).

Reproduce (on 2 CPU cores, at three batch sizes: interleaved, about 10 minutes a
group of 3 cells; in lockstep, about 15 minutes a group of 3 EAGLE-3 or
retrieval cells and 12 a pair with a draft LM, so about 6.5 hours for the
whole grid, best run as several invocations read back with ``--merge``)::

    .venv/bin/vllm-adaptive-spec bench floor-sweep
    .venv/bin/vllm-adaptive-spec bench floor-sweep --drafters eagle3 --policies talon,eagle2-D18 --nodes 32
    .venv/bin/vllm-adaptive-spec bench floor-sweep --cells eagle3/talon/N32,hybrid/eagle2/N32,retrieval/retrieval/N16
    .venv/bin/vllm-adaptive-spec bench floor-sweep --engine-layout lockstep --cells eagle3/talon/N32,eagle3/chain/N32

A sweep run in several invocations (draft-LM groups one per invocation, see
above) is read as one table and plot with ``--merge``: the runs' rows
together, each group's control named after its run, refused where the runs'
workloads differ::

    .venv/bin/vllm-adaptive-spec bench floor-sweep --merge results/fs_a results/fs_b --out results/floor_sweep
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import engines, step_profile
from benchmarks.options import add_batches, add_output, add_workload, check_batches
from benchmarks.report import compare, fmt, installed_vllm_version, machine, machine_line, pyplot, save_ratio_plot, write_report

FLOORS = {"retrieval": 0.97, "eagle3": 0.95, "draft_model": 0.95, "hybrid": 0.95}
MODEL_POLICIES = engines.MODEL_POLICIES
RETRIEVAL_POLICIES = {"retrieval": ("retrieval", {}), "chain": ("chain", {})}


def cells(drafters: list[str], policies: list[str] | None, nodes: list[int], head: str,
          draft_lm: str | None) -> dict[str, dict]:
    """Cell name (``drafter/policy/N``) -> speculative config."""
    out = {}
    for drafter in drafters:
        table = RETRIEVAL_POLICIES if drafter == "retrieval" else MODEL_POLICIES
        for name, (policy, params) in table.items():
            if policies and name not in policies:
                continue
            for n in nodes:
                spec = {"method": "adaptive_tree", "num_speculative_tokens": n,
                        "tree": {"drafter": drafter, "policy": policy, **params}}
                if drafter in ("eagle3", "hybrid"):
                    spec["model"] = head
                elif drafter == "draft_model":
                    spec["model"] = draft_lm or engines.draft_lm_path()
                    if policy == "c2t":  # the draft LM has no classifier of its own: the head's
                        spec["tree"]["classifier"] = str(Path(head) / "c2t_classifier.json")
                out[f"{drafter}/{name}/N{n}"] = spec
    return out


def lockstep_row(passes: list[dict]) -> dict:
    """A cell's lockstep passes at one batch size as ``compare``'s
    row: the median of the passes' ratios to none (each over the same
    steps' span), greedy equality with none's answers in the same pass, the
    plugin's counters summed; "verified" is trees over request steps (every
    request step commits one token plus its accepted drafts)."""
    tree: dict[str, int] = {}
    for run in passes:
        for key, value in run["tree"].items():
            tree[key] = tree.get(key, 0) + value
    tokens, wall_s = sum(run["tokens"] for run in passes), sum(run["wall_s"] for run in passes)
    ratios = [run["ratio"] for run in passes]
    return {"ratio_vs_none": statistics.median(ratios), "ratio_per_round": ratios,
            "same_as_none": [sum(run["same"][0] for run in passes), sum(run["same"][1] for run in passes)],
            "tok_per_s": tokens / wall_s, "tree": tree,
            "drafting_share": tree.get("trees_verified", 0) / max(tokens - tree.get("tokens_accepted", 0), 1)}


def summarize(cell: str, row: dict) -> dict:
    """A table row: the comparison with none, and the plugin's counters."""
    tree = row.get("tree") or {}
    return {
        "cell": cell, "batch_size": row["batch_size"], "ratio": row.get("ratio_vs_none"),
        "rounds": row.get("ratio_per_round"), "same": row.get("same_as_none"), "error": row.get("error"),
        "floor": FLOORS.get(cell.split("/")[0]), "tok_per_s": row.get("tok_per_s"),
        "verified": row.get("drafting_share") or 0.0,
        "drafting_steps": tree.get("drafting_steps", 0), "paused_steps": tree.get("paused", 0), "probes": tree.get("probes", 0),
        "draft_passes": tree.get("draft_passes", 0),
    }


def markdown(report: dict) -> str:
    s = report["settings"]
    lines = [
        "# Floor sweep", "",
        f"held-out prompts, greedy, max_tokens={s['max_tokens']}, dtype={s['dtype']}, "
        f"engines {s.get('engine_layout', 'interleaved')}, rounds={s['rounds']}, "
        f"prompts per batch size {s['prompts_per_batch']}; vLLM {report['vllm_version']}, "
        f"{machine_line(report['machine'])}; {report['timestamp']}", "",
        "ratio: tok/s over no speculation's (median of the rounds, each against none's pass in the same round); "
        "verified: share of request steps that verified a tree; probes, paused: engine steps; passes: draft "
        "passes; same: prompts whose greedy tokens equal none's; ok: ratio at or above the floor and same "
        "text; control/groupK: a second engine without speculation against the first, the group's noise.", "",
        "| cell | b | ratio | floor | ok | verified | probes | paused | passes | same |",
        "|---|---:|---:|---:|:-:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        if r["error"]:
            lines.append(f"| {r['cell']} | {r['batch_size']} | error | {r['floor']} | no | | | | | |")
            continue
        same = r["same"] or [0, 0]
        if r["floor"] is None:  # a group's control: none against none
            lines.append(f"| {r['cell']} | {r['batch_size']} | {fmt(r['ratio'])} | | | | | | | {same[0]}/{same[1]} |")
            continue
        ok = r["ratio"] is not None and r["ratio"] >= r["floor"] and same[0] == same[1]
        lines.append(f"| {r['cell']} | {r['batch_size']} | {fmt(r['ratio'])} | {r['floor']:.2f} | "
                     f"{'yes' if ok else '**no**'} | {r['verified']:.0%} | {r['probes']} | {r['paused_steps']} | "
                     f"{r['draft_passes']} | {same[0]}/{same[1]} |")
    errors = [r for r in report["rows"] if r["error"]]
    if errors:
        lines += ["", "Errors:"] + [f"- {r['cell']} b={r['batch_size']}: {r['error']}" for r in errors]
    lines += ["", f"Total elapsed: {report['elapsed_s']:.0f} s"]
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> list[Path]:
    """Each cell's ratio to no speculation per batch size, with the floors."""
    plt = pyplot()
    if plt is None:
        return []
    rows = [r for r in report["rows"] if r["ratio"] is not None]
    names = list(dict.fromkeys(r["cell"] for r in rows))
    batch_sizes = sorted({r["batch_size"] for r in rows})
    fig, ax = plt.subplots(figsize=(max(8, 0.3 * len(names) + 2), 6.5))
    # Points on a log scale: the cells near a floor stay readable beside the 2x ones.
    width = 0.6 / max(len(batch_sizes), 1)
    for k, b in enumerate(batch_sizes):
        values = {r["cell"]: r["ratio"] for r in rows if r["batch_size"] == b}
        xs = [i + (k - (len(batch_sizes) - 1) / 2) * width for i, n in enumerate(names) if n in values]
        ax.plot(xs, [values[n] for n in names if n in values], "o", markersize=4, label=f"b={b}")
    for floor, style in ((0.95, "--"), (0.97, ":")):
        ax.axhline(floor, color="black", linestyle=style, linewidth=0.8, label=f"floor {floor}")
    ax.axhline(1.0, color="grey", linewidth=0.5)
    ax.set_yscale("log")
    ax.set_ylim(min(0.85, min(r["ratio"] for r in rows) * 0.97), max(1.1, max(r["ratio"] for r in rows) * 1.05))
    ax.set_yticks([0.9, 0.95, 1.0, 1.1, 1.25, 1.5, 2.0], ["0.9", "0.95", "1", "1.1", "1.25", "1.5", "2"])
    ax.minorticks_off()
    ax.set_xticks(range(len(names)), names, rotation=70, ha="right", fontsize=7)
    ax.grid(axis="x", linewidth=0.3)
    save_ratio_plot(plt, fig, ax, out / "floor_sweep.png")
    return [out / "floor_sweep.png"]


# Settings that make two runs' ratios one workload; a merge refuses runs that differ in any.
WORKLOAD = ("batch_sizes", "prompts_per_batch", "max_tokens", "dtype", "prompt_ids", "engine_layout", "rounds")


def merge(reports: dict[str, dict]) -> dict:
    """Several runs' reports (run name -> report) as one: their rows in
    order, each group's control renamed ``control/RUN/groupK`` (every run
    numbers its groups from 1), their cells together; a cell measured by
    several runs keeps the last run's rows (a rerun, of newer code, replaces
    the earlier one). Raises ``ValueError`` naming the setting where two
    runs' workloads differ."""
    (first_name, first), *rest = reports.items()
    for name, report in rest:
        for key in WORKLOAD:
            if report["settings"].get(key) != first["settings"].get(key):
                raise ValueError(f"runs {first_name!r} and {name!r} differ in {key!r}: "
                                 f"{first['settings'].get(key)!r} against {report['settings'].get(key)!r}")
    last_run = {row["cell"]: name for name, report in reports.items() for row in report["rows"]}
    rows, grid = [], {}
    for name, report in reports.items():
        grid.update(report["settings"]["cells"])
        for row in report["rows"]:
            cell = row["cell"]
            if cell.startswith("control/"):
                cell = f"control/{name}/{cell.split('/', 1)[1]}"
            elif last_run[cell] != name:
                continue
            rows.append({**row, "cell": cell})
    return {
        "timestamp": max(report["timestamp"] for report in reports.values()),
        "vllm_version": first["vllm_version"], "machine": first["machine"],
        "settings": {**first["settings"], "cells": grid, "merged_runs": list(reports)},
        "rows": rows, "elapsed_s": sum(report["elapsed_s"] for report in reports.values()),
    }


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--drafters", default="retrieval,eagle3,draft_model,hybrid")
    parser.add_argument("--policies", help="comma list of policy cells (default all): "
                                           f"{', '.join(MODEL_POLICIES)} (retrieval: retrieval, chain)")
    parser.add_argument("--nodes", "--budgets", default="8,32,60")
    parser.add_argument("--cells", help="comma list of cells DRAFTER/POLICY/N (instead of the product of the above)")
    add_batches(parser, "1,8,64", prompts_per_batch="2,16,64")
    add_workload(parser, max_tokens=256)
    add_output(parser, "floor_sweep")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--group-size", type=int, default=3,
                        help="cells interleaved with one none engine; every engine of a group is up at once with "
                             "its own KV cache (3.5 GiB for a draft LM with DEAGLE's depth 18 at batch 64), so "
                             "lower it where vLLM refuses to start for lack of memory")
    parser.add_argument("--engine-layout", choices=("interleaved", "lockstep"), default="interleaved",
                        help="interleaved: each engine in its own process, the engines taking turns by passes; "
                             "lockstep: a group's engines in this process, stepped in turn "
                             "(benchmarks/step_profile.py), so the machine's drift falls on all alike")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--head", default=str(engines.HEAD))
    parser.add_argument("--draft-lm", help="draft LM directory (default: `vllm-adaptive-spec draft-lm`'s)")
    parser.add_argument("--worker-timeout", type=float, default=3600)
    parser.add_argument("--merge", nargs="+", metavar="RUN_DIR",
                        help="instead of measuring: read these runs' floor_sweep.json as one table and plot in --out")
    return parser


def _merged(parser: argparse.ArgumentParser, runs: list[str]) -> dict:
    """The runs' floor_sweep.json as one report."""
    reports = {}
    for run in runs:
        path = Path(run) / "floor_sweep.json"
        if not path.is_file():
            parser.error(f"--merge: {path} not found (a floor sweep's --out directory holds it)")
        reports[Path(run).name] = json.loads(path.read_text(encoding="utf-8"))
    if len(reports) != len(runs):
        parser.error("--merge: two runs have the same directory name; each names its controls")
    try:
        return merge(reports)
    except ValueError as error:
        parser.error(f"--merge: {error}")


def _grid(parser: argparse.ArgumentParser, args) -> dict[str, dict]:
    """The cells measured, by name: ``--cells``, else the product of
    ``--drafters``, ``--policies`` and ``--nodes``."""
    drafters = [d for d in args.drafters.split(",") if d]
    unknown = [d for d in drafters if d not in FLOORS]
    if unknown:
        parser.error(f"unknown drafter(s) {unknown}; choose from {', '.join(FLOORS)}")
    policies = [p for p in args.policies.split(",") if p] if args.policies else None
    nodes = [int(n) for n in args.nodes.split(",")]
    if not args.cells:  # built only now: a draft LM cell distills the draft LM when it is missing
        grid = cells(drafters, policies, nodes, args.head, args.draft_lm)
    else:
        grid = _named_cells(parser, args)
    if not grid:
        parser.error("no cell matches --drafters and --policies")
    return grid


def _named_cells(parser: argparse.ArgumentParser, args) -> dict[str, dict]:
    wanted = [c.strip() for c in args.cells.split(",") if c.strip()]
    parts = [c.split("/") for c in wanted]
    if any(len(p) != 3 or p[0] not in FLOORS or not p[2].startswith("N") or not p[2][1:].isdigit() for p in parts):
        parser.error("--cells takes DRAFTER/POLICY/N, e.g. eagle3/talon/N32")
    grid = {}
    for drafter, policy, n in parts:
        grid.update(cells([drafter], [policy], [int(n[1:])], args.head, args.draft_lm))
    missing = [c for c in wanted if c not in grid]
    if missing:
        parser.error(f"unknown cell(s) {missing}; policies: {', '.join(MODEL_POLICIES)} (retrieval: retrieval, chain)")
    return grid


def _group_rows(args, base_job: dict, group: list[str], grid: dict, index: int, prompt_ids: list[str], log):
    """One group's cells beside its two engines without speculation (``none``
    and the group's control): each cell's and the control's rows."""
    control = f"control/group{index}"  # a second engine without speculation
    labels = {"none": None, control: None, **{name: grid[name] for name in group}}
    jobs = {label.replace("/", "_"): {**base_job, "speculative_config": spec} for label, spec in labels.items()}
    work = args.out / "logs" / f"group{index}"
    work.mkdir(parents=True, exist_ok=True)
    if args.engine_layout == "lockstep":
        steps = step_profile.lockstep(jobs, args.batch_sizes, args.rounds, args.prompts_per_batch)
    else:
        results = engines.run_interleaved(jobs, work, args.rounds, args.worker_timeout, log=log)
    rows = []
    for name in [control, *group]:
        for b in args.batch_sizes:
            if args.engine_layout == "lockstep":
                row = lockstep_row([r for r in steps if r["method"] == name.replace("/", "_") and r["batch_size"] == b])
            else:
                result = results[name.replace("/", "_")]
                passes = [run for run in result["runs"] if run["batch_size"] == b]
                base = [run for run in results["none"]["runs"] if run["batch_size"] == b]
                row = compare(name, True, passes, base, result.get("error"), prompt_ids)
            row["batch_size"] = b
            r = summarize(name, row)
            rows.append(r)
            log(f"  {name} b={b}: {fmt(r['ratio'])}x (floor {r['floor']}), verified {r['verified']:.0%}, "
                f"probes {r['probes']}, passes {r['draft_passes']}, same {r['same']}"
                + (f", error {r['error']}" if r["error"] else ""))
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.merge:
        report = _merged(parser, args.merge)
        write_report(args.out, "floor_sweep", report, markdown(report), plot)
        return

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    t0 = time.perf_counter()

    def log(message: str) -> None:
        print(f"[{time.perf_counter() - t0:6.0f} s] {message}", flush=True)

    check_batches(parser, args)
    grid = _grid(parser, args)
    if args.engine_layout == "lockstep":
        # The step profile's timers reach vLLM's worker as a function, which it pickles only with this set.
        os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"
    base_job, prompts = engines.greedy_job(str(ensure_demo_model()),
                                           engines.interleave_categories(load_prompts(args.prompts)),
                                           args.dtype, args.max_tokens, args.batch_sizes, args.prompts_per_batch)
    rows = []
    names = list(grid)
    groups = [names[i: i + args.group_size] for i in range(0, len(names), args.group_size)]
    for index, group in enumerate(groups, 1):
        log(f"group {index}/{len(groups)}: {', '.join(group)}")
        rows += _group_rows(args, base_job, group, grid, index, [p.id for p in prompts], log)
        report = {
            "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "vllm_version": installed_vllm_version(), "machine": machine(),
            "settings": {
                "cells": grid, "batch_sizes": args.batch_sizes, "prompts_per_batch": args.prompts_per_batch,
                "rounds": args.rounds, "engine_layout": args.engine_layout,
                "max_tokens": args.max_tokens, "dtype": args.dtype, "prompts": args.prompts,
                "prompt_ids": [p.id for p in prompts]},
            "rows": rows, "elapsed_s": time.perf_counter() - t0,
        }
        write_report(args.out, "floor_sweep", report, markdown(report), plot)  # an interrupted sweep keeps what it measured


if __name__ == "__main__":
    main()
