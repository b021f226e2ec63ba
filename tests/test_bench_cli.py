"""``vllm-adaptive-spec bench``: every benchmark tool behind one command,
each answering ``--help``, and no tool reaching its siblings by editing
``sys.path`` (the tools are one package)."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.cli import TOOLS, main

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
    helpers = {"__init__", "cli", "engines", "engine_worker", "gpu_timing", "options", "report"}
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
