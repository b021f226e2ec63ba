"""``make demo``'s program ends cleanly: its summary is the last thing it
prints, with no resource tracker's "leaked semaphore / shared_memory"
warning after it (its engines run in its own process and shut down there)."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.engine
def test_the_demo_ends_with_its_summary_and_leaks_nothing(demo_model):
    """Half the demo's answer length: with vLLM's engine-core processes the
    warnings came in about half such runs, and in every full-length one."""
    done = subprocess.run([sys.executable, "-m", "vllm_adaptive_spec.demo", "--model", demo_model,
                           "--max-tokens", "64"], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.rstrip().splitlines()[-1].startswith("speed ratio (adaptive_tree / none):"), done.stdout[-500:]
    assert "leaked" not in done.stderr, done.stderr[-2000:]
