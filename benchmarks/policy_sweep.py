"""Tree policies side by side on the demo pair (SmolLM2-135M-Instruct and the
project's EAGLE-3 head), in one run.

Methods (every tree at ``load_budget: fixed``, so the policy alone decides
what is verified): the ``chain`` baseline (depth ``--chain-k``); ``eagle2``
(N=60, K=10, D=8), eagle2 at each depth of the DEAGLE sweep and at the
N of ``--eagle2-nodes`` (to compare with a policy that verifies fewer nodes); ``talon``
(N=60, ``mu`` 0.03 and 0.01); ``deagle`` (N=60, K=10, maximum depth ``D`` from
``--depths``); ``dynatree`` (N=60, the spec's defaults); ``c2t`` (N=60, K=10,
``d_max`` 10, ``beta`` 0.5, the head's shipped classifier); Talon's comparison:
``retrieval`` alone (N=16, the retrieval policy), and ``hybrid-eagle2`` /
``hybrid-dynatree`` (the head and the retrieval trie merged, with the same
policy and settings as ``eagle2`` / ``dynatree``); and no speculation.

For every method, at batch 1 and 16 (``--batch-sizes``), and temperature 0 and 1
(``--temperatures``; one engine per method and temperature): tau (tokens
committed per step of a request that drafted), delta (draft passes per engine
step that drafted), gamma (nodes verified per tree), tok/s and the ratio to no
speculation at the same batch size and temperature; at batch 1 each prompt
category is a pass of its own, so tau, delta and gamma are also reported per
category.

Engines run through ``benchmarks/engines.py`` (a fresh process per
engine, vLLM's in-process layout by default). Outputs in ``--out``:
``policy_sweep.json`` (every number and setting), ``policy_sweep.md`` (tables)
and, with matplotlib installed (``pip install -e .[bench]``),
``policy_sweep_tau_gamma.png`` and ``policy_sweep_tau_delta.png`` (one point
per method, per batch size and temperature).

Reproduce (about 40 minutes on 2 CPU cores)::

    .venv/bin/vllm-adaptive-spec bench policy-sweep
    # a smaller run
    .venv/bin/vllm-adaptive-spec bench policy-sweep --methods none,eagle2,talon-0.03,dynatree --temperatures 0
"""

from __future__ import annotations

import argparse
import time
from datetime import datetime, timezone
from pathlib import Path

from benchmarks import engines
from benchmarks.options import add_batches, add_output, add_workload
from benchmarks.report import fmt, installed_vllm_version, machine, pyplot, write_report


TREE_NODES = 60


RETRIEVAL_BUDGET = 16


def _tree(head: str, policy: str, nodes: int = TREE_NODES, drafter: str = "eagle3", **params) -> dict:
    return {"method": "adaptive_tree", "num_speculative_tokens": nodes, "model": head,
            "tree": {"drafter": drafter, "policy": policy, "load_budget": "fixed", **params}}


def sweep_methods(head: str, chain_k: int, depths: list[int], extra_nodes: list[int] = ()) -> dict[str, dict | None]:
    methods: dict[str, dict | None] = {
        "none": None,
        "chain": _tree(head, "chain", chain_k),
        "eagle2": _tree(head, "eagle2", top_k=10, depth=8),
        "talon-0.03": _tree(head, "talon", mu=0.03),
        "talon-0.01": _tree(head, "talon", mu=0.01),
        "dynatree": _tree(head, "dynatree"),
        "c2t": _tree(head, "c2t"),
        "retrieval": {"method": "adaptive_tree", "num_speculative_tokens": RETRIEVAL_BUDGET,
                      "tree": {"drafter": "retrieval", "policy": "retrieval", "load_budget": "fixed"}},
        "hybrid-eagle2": _tree(head, "eagle2", drafter="hybrid", top_k=10, depth=8),
        "hybrid-dynatree": _tree(head, "dynatree", drafter="hybrid"),
    }
    for n in extra_nodes:  # eagle2 trees of the size another policy verifies
        methods[f"eagle2-N{n}"] = _tree(head, "eagle2", n, top_k=10, depth=8)
    for depth in depths:
        methods[f"deagle-D{depth}"] = _tree(head, "deagle", top_k=10, depth=depth)
        if depth != 8:
            methods[f"eagle2-D{depth}"] = _tree(head, "eagle2", top_k=10, depth=depth)
    return methods


def summarize(spec: dict, tree: dict | None, tokens: int, wall_s: float) -> dict:
    """tau, gamma, delta of one pass from vLLM's counters and the plugin's."""
    row = {"tok_per_s": tokens / wall_s if wall_s else None, "tau": None, "gamma": None, "delta": None}
    if spec["drafts"]:
        row["tau"] = 1 + spec["accepted_tokens"] / spec["drafts"]
        row["gamma"] = spec["draft_tokens"] / spec["drafts"]
    if tree and tree.get("drafting_steps"):
        row["delta"] = tree["draft_passes"] / tree["drafting_steps"]
    return row


def markdown(report: dict) -> str:
    lines = []
    for temperature in report["settings"]["temperatures"]:
        for batch in report["settings"]["batch_sizes"]:
            lines += [f"### temperature {temperature}, batch {batch}", "",
                      "| method | tau | delta | gamma | tok/s | vs none |", "|---|---:|---:|---:|---:|---:|"]
            for row in report["rows"]:
                if row["temperature"] != temperature or row["batch_size"] != batch:
                    continue
                if "error" in row:
                    lines.append(f"| {row['method']} | {row['error']} |")
                    continue
                lines.append(f"| {row['method']} | {fmt(row['tau'])} | {fmt(row['delta'])} | {fmt(row['gamma'], '.1f')} "
                             f"| {fmt(row['tok_per_s'], '.1f')} | {fmt(row.get('ratio_vs_none'))} |")
            lines.append("")
    categories = sorted({c for row in report["rows"] for c in row.get("by_category", {})})
    if categories:
        for temperature in report["settings"]["temperatures"]:
            lines += [f"### tau per category (batch 1, temperature {temperature})", "",
                      "| method | " + " | ".join(categories) + " |", "|---|" + "---:|" * len(categories)]
            for row in report["rows"]:
                if row["temperature"] == temperature and row["batch_size"] == 1 and row.get("by_category"):
                    cells = [fmt(row["by_category"].get(c, {}).get("tau")) for c in categories]
                    lines.append(f"| {row['method']} | " + " | ".join(cells) + " |")
            lines.append("")
    return "\n".join(lines)


def plots(report: dict, out: Path) -> list[Path]:
    """tau against nodes verified per tree and against draft passes per step."""
    plt = pyplot()
    if plt is None:
        return []
    written = []
    for x_key, label in (("gamma", "nodes verified per tree (gamma)"), ("delta", "draft passes per step (delta)")):
        fig, axes = plt.subplots(1, len(report["settings"]["batch_sizes"]), figsize=(6 * len(report["settings"]["batch_sizes"]), 4.5),
                                 squeeze=False)
        for axis, batch in zip(axes[0], report["settings"]["batch_sizes"]):
            for temperature, marker in zip(report["settings"]["temperatures"], "os^"):
                for row in report["rows"]:
                    if row["batch_size"] != batch or row["temperature"] != temperature:
                        continue
                    if row.get(x_key) is None or row.get("tau") is None:
                        continue
                    axis.scatter(row[x_key], row["tau"], marker=marker)
                    axis.annotate(f"{row['method']} T{temperature:g}", (row[x_key], row["tau"]), fontsize=7,
                                  xytext=(3, 3), textcoords="offset points")
            axis.set_xlabel(label)
            axis.set_ylabel("tokens per step (tau)")
            axis.set_title(f"batch {batch}")
            axis.grid(alpha=0.3)
        fig.tight_layout()
        path = out / f"policy_sweep_tau_{x_key}.png"
        fig.savefig(path, dpi=110)
        plt.close(fig)
        written.append(path)
    return written


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", help="comma list (default: all of the sweep)")
    parser.add_argument("--depths", default="6,10,18", help="DEAGLE's (and eagle2's) maximum depths")
    parser.add_argument("--eagle2-nodes", "--eagle2-budgets", default="", help="extra eagle2 trees of these N (methods eagle2-N<n>)")
    add_batches(parser, "1,16")
    parser.add_argument("--temperatures", default="0,1")
    parser.add_argument("--prompts-at-batch-1", type=int, default=7, help="prompts of the batch-1 pass (round-robin over categories)")
    parser.add_argument("--prompts-at-batch", type=int, default=32, help="prompts of the other passes")
    add_workload(parser, max_tokens=48, prompts=None)
    parser.add_argument("--chain-k", type=int, default=4)
    parser.add_argument("--head", default=str(engines.HEAD))
    parser.add_argument("--engine-layout", choices=("processes", "in-process"), default="in-process")
    parser.add_argument("--worker-timeout", type=float, default=1800)
    add_output(parser)
    return parser


def _methods(parser: argparse.ArgumentParser, args) -> dict[str, dict | None]:
    """The sweep's methods (``--methods`` of them), no speculation first."""
    depths = [int(d) for d in args.depths.split(",") if d.strip()]
    extra_nodes = [int(n) for n in args.eagle2_nodes.split(",") if n.strip()]
    methods = sweep_methods(args.head, args.chain_k, depths, extra_nodes)
    if args.methods:
        chosen = [m.strip() for m in args.methods.split(",") if m.strip()]
        unknown = [m for m in chosen if m not in methods]
        if unknown:
            parser.error(f"unknown method(s) {unknown}; choose from {', '.join(methods)}")
        methods = {m: methods[m] for m in chosen}
    return methods if "none" in methods else {"none": None, **methods}


def _engine_rows(method: str, temperature: float, result: dict, batch_sizes: list[int], base: dict) -> list[dict]:
    """One engine's rows, a batch size each; ``base``: no speculation's tok/s by
    (temperature, batch size), filled by its own rows."""
    done = {run["batch_size"]: run for run in result["runs"]}
    rows = []
    for batch in batch_sizes:
        row = {"method": method, "temperature": temperature, "batch_size": batch}
        run = done.get(batch)
        if run is None:
            rows.append({**row, "error": result.get("error", "no result")})
            continue
        row.update(summarize(run["spec"], run.get("tree"), run["generated_tokens"], run["wall_s"]))
        row["by_category"] = {
            category: summarize(part["spec"], part.get("tree"), part["generated_tokens"], part["wall_s"])
            for category, part in run["by_category"].items()
        }
        if method == "none":
            base[(temperature, batch)] = row["tok_per_s"]
        elif base.get((temperature, batch)):
            row["ratio_vs_none"] = row["tok_per_s"] / base[(temperature, batch)]
        print(f"  b={batch}: tau {fmt(row['tau'])} delta {fmt(row['delta'])} gamma {fmt(row['gamma'], '.1f')} "
              f"{fmt(row['tok_per_s'], '.1f')} tok/s ({fmt(row.get('ratio_vs_none'))}x)", flush=True)
        rows.append(row)
    if "error" in result:
        print(f"  FAILED: {result['error']}; log: {result.get('log')}", flush=True)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = _parser()
    args = parser.parse_args(argv)

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    t0 = time.perf_counter()
    methods = _methods(parser, args)
    batch_sizes = args.batch_sizes
    temperatures = [float(t) for t in args.temperatures.split(",")]
    model = str(ensure_demo_model())
    prompts = engines.interleave_categories(load_prompts(args.prompts))
    sizes = [args.prompts_at_batch_1 if b == 1 else args.prompts_at_batch for b in batch_sizes]
    prompts = prompts[: max(sizes + [2])]
    work = args.out / "logs"
    work.mkdir(parents=True, exist_ok=True)
    base_job = {
        "model": model, "dtype": "float32",
        "max_model_len": engines.needed_model_len(model, [p.messages for p in prompts], args.max_tokens),
        "max_tokens": args.max_tokens, "warmup_prompts": 2, "conversations": [p.messages for p in prompts],
        "categories": [p.category for p in prompts], "by_category": [1], "engine_layout": args.engine_layout,
        "batch_sizes": batch_sizes, "num_prompts": sizes, "max_num_seqs": max(batch_sizes),
    }
    rows, base = [], {}
    plan = [(t, m) for t in temperatures for m in methods]
    for index, (temperature, method) in enumerate(plan, 1):
        print(f"[{time.perf_counter() - t0:6.0f} s] engine {index}/{len(plan)}: {method}, temperature {temperature}", flush=True)
        job = {**base_job, "temperature": temperature, "speculative_config": methods[method]}
        result = engines.run_engine(job, work, f"sweep-{method}-T{temperature:g}", args.worker_timeout)
        rows += _engine_rows(method, temperature, result, batch_sizes, base)
    report = {
        "timestamp": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "vllm_version": installed_vllm_version(),
        "machine": machine(),
        "settings": {"methods": methods, "batch_sizes": batch_sizes, "temperatures": temperatures, "prompts": sizes,
                     "max_tokens": args.max_tokens, "engine_layout": args.engine_layout,
                     "prompt_ids": [p.id for p in prompts]},
        "rows": rows,
        "elapsed_s": time.perf_counter() - t0,
    }
    write_report(args.out, "policy_sweep", report, markdown(report), plots)


if __name__ == "__main__":
    main()
