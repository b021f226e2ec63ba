"""The quick tier is honest: a test that starts an engine without the
``engine`` mark fails at once (conftest's guard), before the engine starts."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import UnmarkedEngineTest, run_engine_job


def test_an_unmarked_test_cannot_run_an_engine_job(tmp_path):
    with pytest.raises(UnmarkedEngineTest, match="needs @pytest.mark.engine"):
        run_engine_job(tmp_path, {"model": "never-started"})
    assert not (tmp_path / "job.json").exists()


@pytest.mark.parametrize("argv", [
    [sys.executable, "tests/engine_job.py", "job.json", "out.json"],
    [sys.executable, "-m", "vllm_adaptive_spec.demo", "--model", "m"],
    [sys.executable, "-m", "vllm_adaptive_spec.cli", "vllm", "serve", "m"],
    [sys.executable, "-m", "benchmarks.draft_host_time", "--one", "retrieval:1"],
    ["bash", "scripts/gpu_checks.sh", "--dry-run", "out", "480"],
])
def test_an_unmarked_test_cannot_start_an_engine_process(argv):
    with pytest.raises(UnmarkedEngineTest):
        subprocess.run(argv, capture_output=True)


def test_an_unmarked_test_may_run_other_processes():
    done = subprocess.run([sys.executable, "-c", "print('ok')"], capture_output=True, text=True)
    assert done.stdout.strip() == "ok"


def test_every_module_that_runs_engine_jobs_carries_the_mark():
    """The guard above runs only where a test runs; a module skipped here (the
    GPU's) is checked by its text, so a lent GPU's tests are not refused."""
    from pathlib import Path

    tests = Path(__file__).parent
    unmarked = [path.name for path in tests.rglob("test_*.py")
                if "run_engine_job(" in path.read_text() and "pytest.mark.engine" not in path.read_text()]
    assert unmarked == []
