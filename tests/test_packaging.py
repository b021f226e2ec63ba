"""A non-editable install (a wheel) carries every package of the tree, the
benchmarks with their serving tools and prompt sets, the CPU tree
attention's C++ source (built on first use) and the two entry points."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def source_copy(destination: Path) -> Path:
    """The files a commit would hold (tracked, or new and not ignored), copied
    as a clean clone has them: no build left from an earlier run."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (destination / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, destination / name)
    return destination


def test_the_wheel_carries_what_an_installed_copy_runs(tmp_path):
    source = source_copy(tmp_path / "source")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                    str(source), "-w", str(tmp_path)], check=True, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    packages = {path.relative_to(ROOT).as_posix() for folder in ("vllm_adaptive_spec", "kernels", "benchmarks")
                for path in (ROOT / folder).rglob("__init__.py")}
    assert "benchmarks/serving/__init__.py" in packages
    assert sorted(packages - names) == []
    data = {"benchmarks/data/heldout_prompts.jsonl", "kernels/tree_attention_cpu.cpp", "vllm_adaptive_spec/data/prompts.jsonl"}
    assert sorted(data - names) == []
    (entry_points,) = [name for name in names if name.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "vllm-adaptive-spec = vllm_adaptive_spec.cli:main" in text
    assert "adaptive_spec = vllm_adaptive_spec.plugin:register" in text
