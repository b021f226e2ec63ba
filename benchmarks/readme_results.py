"""``vllm-adaptive-spec bench readme``: the README's CPU results, regenerated
by one command, never copied by hand.

Runs the README's table with ``bench throughput``: the held-out prompts
(never used for tuning), engines interleaved in 2 rounds, batch 1, 8 and 64,
answers of up to 128 and of up to 256 tokens, no speculation, vLLM's
``ngram`` and ``suffix`` and ``adaptive_tree`` at its defaults. It writes the
table (stamped with the commit, the machine and the date it ran on) to
``benchmarks/figures/readme/results.md``, its plot beside it, the two runs'
full reports under ``tokens_128/`` and ``tokens_256/``, and puts the table
into ``README.md`` between its markers. ``tests/test_readme_results.py``
fails when the README's table is not the file this command wrote.

Reproduce (about an hour on 2 CPU cores)::

    .venv/bin/vllm-adaptive-spec bench readme
    # the table and plot again from the committed runs, no engine started
    .venv/bin/vllm-adaptive-spec bench readme --from-reports
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks import throughput
from benchmarks.options import HELDOUT, REPO, add_output
from benchmarks.report import machine_line, pyplot, save_ratio_plot, write_report

OUT = REPO / "benchmarks" / "figures" / "readme"
README = REPO / "README.md"
START = "<!-- results: written by `vllm-adaptive-spec bench readme`; do not edit by hand -->"
END = "<!-- end of results -->"
METHODS = {"ngram": "ngram (K = 4)", "suffix": "suffix", "tree-retrieval": "**adaptive_tree** (defaults)"}
ANSWER_TOKENS = (128, 256)
BATCH_SIZES = (1, 8, 64)


def throughput_argv(tokens: int, out: Path) -> list[str]:
    """The ``bench throughput`` command line of one answer length."""
    return ["--engine-layout", "in-process", "--engine-per", "interleaved", "--rounds", "2",
            "--prompts", str(HELDOUT), "--batch-sizes", ",".join(map(str, BATCH_SIZES)),
            "--max-tokens", str(tokens), "--methods", ",".join(["none", *METHODS]), "--out", str(out)]


def cell(row: dict | None) -> str:
    """One method at one batch size: the median ratio (the rounds' range), tau,
    and a warning where greedy output differed from no speculation."""
    if row is None or "error" in row:
        return "error" if row else "not run"
    rounds = row.get("ratio_per_round") or [row["ratio_vs_none"]]
    text = f"{row['ratio_vs_none']:.2f}x ({min(rounds):.2f}-{max(rounds):.2f}), tau {row['tau']:.2f}"
    same = row.get("same_as_none")
    if same and same[0] != same[1]:
        text += f", greedy equal {same[0]}/{same[1]}"
    return text


def table(reports: dict[int, dict], stamp: dict) -> str:
    """The README's table: per answer length and batch size, no speculation's
    tok/s and each method's speed over it."""
    lines = ["| answers up to | batch | none tok/s | " + " | ".join(METHODS.values()) + " |",
             "|---:|---:|---:|" + "---|" * len(METHODS)]
    for tokens, report in sorted(reports.items()):
        rows = {(row["batch_size"], row["method"]): row for row in report["results"]}
        for batch in BATCH_SIZES:
            none = rows.get((batch, "none"))
            base = f"{none['tok_per_s']:.1f}" if none and "error" not in none else "error"
            cells = [cell(rows.get((batch, method))) for method in METHODS]
            lines.append(f"| {tokens} | {batch} | {base} | " + " | ".join(cells) + " |")
    lines += ["", f"Measured at commit `{stamp['commit']}` on {stamp['machine']}, vLLM {stamp['vllm']}, "
                  f"{stamp['date']}, by `vllm-adaptive-spec bench readme` ({stamp['minutes']:.0f} min). "
                  "Speed over no speculation: the median of 2 interleaved rounds (their range), then tau "
                  "(tokens per drafting step); greedy output equal to no speculation unless the cell says not."]
    return "\n".join(lines) + "\n"


def plot(reports: dict[int, dict], path: Path) -> list[Path]:
    """Each method's speed over no speculation against the batch size, one
    panel per answer length."""
    plt = pyplot()
    if plt is None:
        return []
    fig, axes = plt.subplots(1, len(reports), figsize=(4.2 * len(reports), 3.4), sharey=True)
    for ax, (tokens, report) in zip(list(axes) if len(reports) > 1 else [axes], sorted(reports.items())):
        for method, label in METHODS.items():
            mine = sorted((row for row in report["results"] if row["method"] == method
                           and row.get("ratio_vs_none") is not None), key=lambda row: row["batch_size"])
            x = [BATCH_SIZES.index(row["batch_size"]) for row in mine]
            ax.plot(x, [row["ratio_vs_none"] for row in mine], marker="o", label=label.replace("*", ""))
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks(range(len(BATCH_SIZES)), [str(b) for b in BATCH_SIZES])
        ax.set_xlabel(f"batch size (answers up to {tokens} tokens)")
    save_ratio_plot(plt, fig, axes[0] if len(reports) > 1 else axes, path)
    return [path]


def readme_block(text: str) -> str | None:
    """What the README holds between its markers, or None without them."""
    if START not in text or END not in text:
        return None
    return text.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def with_block(text: str, block: str) -> str:
    """The README with ``block`` between its markers."""
    if readme_block(text) is None:
        raise SystemExit(f"README.md has no results markers ({START} ... {END})")
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{block.rstrip()}\n{END}{rest.split(END, 1)[1]}"


def stamp_of(reports: dict[int, dict]) -> dict:
    """What the table names: the commit(s), machine, vLLM and date of the runs."""
    last = max(reports.values(), key=lambda report: report["timestamp"])
    commits = {report.get("commit") or "unknown" for report in reports.values()}
    return {"commit": ", ".join(sorted(commits)), "machine": machine_line(last["machine"]),
            "vllm": last["vllm_version"], "date": last["timestamp"][:10],
            "minutes": sum(report["elapsed_s"] for report in reports.values()) / 60}


def load_reports(out: Path) -> dict[int, dict]:
    reports = {}
    for tokens in ANSWER_TOKENS:
        path = out / f"tokens_{tokens}" / "throughput.json"
        if not path.is_file():
            raise SystemExit(f"{path} is missing: run `vllm-adaptive-spec bench readme` without --from-reports")
        reports[tokens] = json.loads(path.read_text())
    return reports


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-adaptive-spec bench readme", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_output(parser)
    parser.set_defaults(out=OUT)
    parser.add_argument("--from-reports", action="store_true", help="redraw from the runs already in --out")
    parser.add_argument("--no-readme", action="store_true", help="leave README.md as it is")
    args = parser.parse_args(argv)
    if not args.from_reports:
        for tokens in ANSWER_TOKENS:
            throughput.main(throughput_argv(tokens, args.out / f"tokens_{tokens}"))
    reports = load_reports(args.out)
    stamp = stamp_of(reports)
    text = table(reports, stamp)
    runs = {str(tokens): f"tokens_{tokens}/throughput.json" for tokens in reports}
    write_report(args.out, "results", {"stamp": stamp, "runs": runs}, text,
                 lambda report, out: plot(reports, out / "results.png"))
    if not args.no_readme:
        README.write_text(with_block(README.read_text(), text), encoding="utf-8")
        print("wrote README.md")
