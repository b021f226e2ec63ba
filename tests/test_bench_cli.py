"""``vllm-adaptive-spec bench``: every benchmark tool behind one command,
each answering ``--help``, and no tool reaching its siblings by editing
``sys.path`` (the tools are one package), the shared flags and the one
report writer."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.bench import TOOLS, main

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_answers_help(tool, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main([tool, "--help"])
    assert exit_info.value.code == 0
    assert "usage:" in capsys.readouterr().out


def test_every_tool_module_is_listed():
    """A tool added to the package is reachable from the command (the
    package's helpers excepted)."""
    helpers = {"__init__", "chain_drafters", "bench", "engines", "engine_worker", "gpu_timing", "options", "phase_times", "report"}
    modules = {path.stem for path in BENCHMARKS.glob("*.py")} - helpers
    assert modules == {module for module, _ in TOOLS.values()}


def test_no_tool_edits_sys_path():
    offenders = [path.name for path in BENCHMARKS.glob("*.py") if "sys.path" in path.read_text(encoding="utf-8")]
    assert not offenders


def test_no_benchmark_file_is_over_450_lines():
    long = {path.relative_to(BENCHMARKS).as_posix(): n for path in BENCHMARKS.rglob("*.py")
            if (n := len(path.read_text(encoding="utf-8").splitlines())) > 450}
    assert not long


def test_importing_a_tool_changes_no_environment(monkeypatch):
    """A tool sets what its engines need when it runs, not when imported
    (the suite imports every tool)."""
    import importlib
    import os
    import sys

    before = dict(os.environ)
    for module, _ in TOOLS.values():
        monkeypatch.delitem(sys.modules, f"benchmarks.{module}", raising=False)
        importlib.import_module(f"benchmarks.{module}")
    assert dict(os.environ) == before


SHARED_FLAGS = ("--out", "--max-tokens", "--prompts", "--batch-sizes", "--prompts-per-batch")


def test_shared_flags_are_defined_once():
    """``--out``, the workload and the batch sizes come from the shared
    groups in ``benchmarks/options.py``: every tool spells, types and checks
    them alike."""
    offenders = sorted(f"{path.name}: {flag}" for path in BENCHMARKS.rglob("*.py") if path.name != "options.py"
                       for flag in SHARED_FLAGS if f'add_argument("{flag}"' in path.read_text(encoding="utf-8"))
    assert not offenders


@pytest.mark.parametrize("tool", sorted(TOOLS))
def test_every_tool_writes_through_the_one_report_writer(tool):
    """Each tool takes the shared ``--out`` and keeps its results with
    ``write_report`` (JSON, Markdown, plot), writing no report file itself."""
    module, _ = TOOLS[tool]
    text = (BENCHMARKS / f"{module}.py").read_text(encoding="utf-8")
    assert "add_output(parser" in text and "write_report(" in text
    assert '.md").write_text' not in text and ".md\").write_text" not in text


def test_the_report_writer_keeps_json_markdown_and_plots(tmp_path, capsys):
    from benchmarks.options import REPO
    from benchmarks.report import write_report

    def plot(report, out):
        (out / "x.png").write_bytes(b"png")
        return [out / "x.png"]

    report = {"prompts": REPO / "benchmarks" / "data" / "heldout_prompts.jsonl", "rows": [1, 2]}
    written = write_report(tmp_path / "run", "x", report, "| a |\n|---|\n", plot)
    assert [p.name for p in written] == ["x.json", "x.md", "x.png"]
    import json

    assert json.loads(written[0].read_text()) == {"prompts": "benchmarks/data/heldout_prompts.jsonl", "rows": [1, 2]}
    assert written[1].read_text() == "| a |\n|---|\n"
    assert "| a |" in capsys.readouterr().out


def test_the_shared_batch_flags_check_their_input(capsys):
    import argparse

    from benchmarks.options import add_batches, add_workload, check_batches

    parser = argparse.ArgumentParser()
    add_batches(parser, "1,8", prompts_per_batch="2,16")
    add_workload(parser, max_tokens=64)
    args = parser.parse_args([])
    assert (args.batch_sizes, args.prompts_per_batch, args.max_tokens) == ([1, 8], [2, 16], 64)
    check_batches(parser, args)
    for argv in (["--batch-sizes", "1,x"], ["--batch-sizes", "0"], ["--max-tokens", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(argv)
    with pytest.raises(SystemExit):
        check_batches(parser, parser.parse_args(["--batch-sizes", "1,8,64"]))
    assert "one count per batch size (3), got 2" in capsys.readouterr().err


def test_a_job_without_a_speculative_config_opens_a_plain_engine():
    """``retrieval-calibration`` and ``row-cost`` open engines from jobs that
    name no speculative config (a smoke run found them failing on it)."""
    from benchmarks.engine_worker import is_tree_method

    assert not is_tree_method({"model": "m", "dtype": "float32"})
    assert not is_tree_method({"speculative_config": None})
    assert is_tree_method({"speculative_config": {"method": "adaptive_tree"}})
