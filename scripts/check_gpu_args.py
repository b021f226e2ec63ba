"""Check every stage of ``scripts/gpu_checks.sh`` here, without running it:
each tool's arguments through the tool's own parser, its method names
through the tool's own method table, its files, and the pytest stages' node
ids and options by collecting them. A misspelled flag, method, path or test
id fails here rather than on the GPU, where a call costs minutes.

    bash scripts/gpu_checks.sh --check-args [--only STAGE,...] [--no-collect]

Both variants are checked: the GPU run's commands and the dry run's, which
must use the same tools with the same flags (values aside; the pytest stages
add ``--collect-only``) and, per tool, a subset of the GPU run's methods.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import subprocess
import sys
import tempfile
from pathlib import Path
from unittest import mock

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
DRY_ONLY_FLAGS = {"--collect-only"}  # what the dry run adds to a stage
LIST_FLAGS = ("--methods", "--drafters")  # comma lists of methods: the dry run's must be among the GPU run's


def stages(script: Path, dry: bool) -> list[dict]:
    """``gpu_checks.sh --list``: each stage's name, expected outputs and command."""
    done = subprocess.run(["bash", str(script), "--list", *(["--dry-run"] if dry else [])],
                          capture_output=True, text=True, check=True)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("[")]
    return [{"name": name, "expect": expect.split(","), "argv": argv} for name, expect, *argv in rows]


class _Parsed(Exception):
    def __init__(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
        super().__init__()
        self.parser, self.namespace = parser, args


def parse(module_name: str, argv: list[str]) -> tuple[argparse.ArgumentParser, argparse.Namespace]:
    """Run ``module.main(argv)`` up to its first ``parse_args``; the parser
    and what it parsed. Raises ValueError with argparse's message on a bad
    argument."""
    module = importlib.import_module(module_name)
    original = argparse.ArgumentParser.parse_args

    def capture(self, args=None, namespace=None):
        raise _Parsed(self, original(self, args, namespace))

    said = io.StringIO()
    with mock.patch.object(argparse.ArgumentParser, "parse_args", capture), contextlib.redirect_stderr(said), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            module.main(argv)
        except _Parsed as parsed:
            return parsed.parser, parsed.namespace
        except SystemExit as exit_:
            raise ValueError(said.getvalue().strip().splitlines()[-1] if said.getvalue().strip()
                             else f"exit {exit_.code}") from None
    raise ValueError(f"{module_name}.main returned without parsing its arguments")


def _methods(module_name: str, parser, args) -> None:
    """The tool's own check of its method names (raises on an unknown one)."""
    if module_name == "benchmarks.throughput":
        from benchmarks import throughput

        with contextlib.redirect_stderr(io.StringIO()) as said:
            try:
                throughput._methods(parser, args)
            except SystemExit:
                raise ValueError(said.getvalue().strip().splitlines()[-1]) from None
    elif module_name in ("benchmarks.step_profile", "benchmarks.sync_check"):
        from benchmarks.step_profile import method_config

        for method in args.methods.split(","):
            method_config(method)
    elif module_name == "benchmarks.draft_host_time":
        from benchmarks.draft_host_time import spec_of

        for drafter in args.drafters.split(","):
            try:
                spec_of(drafter, args.nodes, args.head)
            except KeyError:
                raise ValueError(f"unknown drafter {drafter!r}") from None


def module_of(argv: list[str]) -> tuple[str, list[str]] | None:
    """``python3 benchmarks/X.py ARGS`` or ``python3 -m MODULE ARGS``: (module, ARGS)."""
    if argv[1] == "-m":
        return argv[2], argv[3:]
    if argv[1].endswith(".py"):
        return argv[1].removesuffix(".py").replace("/", "."), argv[2:]
    return None


def check(stage: dict, collect: bool = True) -> list[str]:
    """What is wrong with one stage's command (nothing: an empty list)."""
    argv, problems = stage["argv"], []
    if argv[0] != "python3":
        return [f"runs {argv[0]!r}, not python3"]
    if argv[1] == "-c":
        try:
            compile(argv[2], f"<{stage['name']}>", "exec")
        except SyntaxError as error:
            problems.append(f"its Python does not compile: {error}")
        return problems
    if argv[1:3] == ["-m", "pytest"]:
        return _collect(argv[3:]) if collect else []
    found = module_of(argv)
    if found is None:
        return [f"not a command this checker knows: {argv[:3]}"]
    module_name, args_list = found
    if argv[1].endswith(".py") and not (REPO / argv[1]).is_file():
        return [f"no file {argv[1]}"]
    try:
        parser, args = parse(module_name, args_list)
        _methods(module_name, parser, args)
    except (ValueError, ImportError) as error:
        return [f"{module_name}: {error}"]
    for key, value in vars(args).items():
        if (isinstance(value, Path) or key == "head" and value) and key != "out" and not (REPO / value).exists():
            problems.append(f"--{key.replace('_', '-')} {value}: no such file")
    return problems


def _collect(pytest_args: list[str]) -> list[str]:
    """Collect a pytest stage's tests with its own options (its JUnit file
    written to a scratch folder): a node id that names no test fails."""
    with tempfile.TemporaryDirectory() as scratch:
        args = [f"--junitxml={scratch}/x.xml" if a.startswith("--junitxml=") else a for a in pytest_args]
        if "--collect-only" not in args:
            args.append("--collect-only")
        done = subprocess.run([sys.executable, "-m", "pytest", *args], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        return [f"pytest collection failed (exit {done.returncode}): {' / '.join(lines[-3:])}"]
    return []


def _is_test(arg: str) -> bool:
    """A pytest stage's test path or node id (not an option or its value)."""
    return arg.startswith("tests/")


def flags(argv: list[str]) -> set[str]:
    return {a.split("=", 1)[0] for a in argv if a.startswith("--")}


def compare(gpu: dict, dry: dict) -> list[str]:
    """The dry run's command against the GPU run's: the same tool and flags;
    for method lists, a subset."""
    problems = []
    if gpu["argv"][:3] != dry["argv"][:3]:
        problems.append(f"the dry run runs {dry['argv'][:3]}, the GPU run {gpu['argv'][:3]}")
    if flags(gpu["argv"]) != flags(dry["argv"]) - DRY_ONLY_FLAGS:
        problems.append(f"flags differ from the GPU run's: {sorted(flags(gpu['argv']) ^ (flags(dry['argv']) - DRY_ONLY_FLAGS))}")
    if gpu["expect"] != dry["expect"]:
        problems.append(f"outputs differ from the GPU run's: {dry['expect']} against {gpu['expect']}")
    for flag in LIST_FLAGS:
        if flag in gpu["argv"] and flag in dry["argv"]:
            wanted = set(gpu["argv"][gpu["argv"].index(flag) + 1].split(","))
            extra = set(dry["argv"][dry["argv"].index(flag) + 1].split(",")) - wanted
            if extra:
                problems.append(f"{flag}: the dry run's {sorted(extra)} are not in the GPU run")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--script", type=Path, default=REPO / "scripts" / "gpu_checks.sh")
    parser.add_argument("--only", help="comma list of stages to check (default: all)")
    parser.add_argument("--no-collect", action="store_true", help="skip the pytest stages' collection")
    args = parser.parse_args(argv)
    gpu, dry = stages(args.script, False), stages(args.script, True)
    only = set(args.only.split(",")) if args.only else None
    failed = 0
    collected = set()  # pytest stages whose tests collect together (one pytest process: seconds each)
    if not args.no_collect:
        groups: dict[tuple, list[dict]] = {}
        for stage in gpu:
            if stage["argv"][1:3] == ["-m", "pytest"] and (only is None or stage["name"] in only):
                options = tuple(a for a in stage["argv"][3:] if not _is_test(a) and not a.startswith("--junitxml="))
                groups.setdefault(options, []).append(stage)
        for options, group in groups.items():
            ids = [a for stage in group for a in stage["argv"][3:] if _is_test(a)]
            if len(group) > 1 and not _collect([*options, *ids]):
                collected.update(stage["name"] for stage in group)
    if [s["name"] for s in gpu] != [s["name"] for s in dry]:
        print(f"the dry run's stages {[s['name'] for s in dry]} differ from the GPU run's {[s['name'] for s in gpu]}")
        failed += 1
    for gpu_stage, dry_stage in zip(gpu, dry):
        if only is not None and gpu_stage["name"] not in only:
            continue
        collect = not args.no_collect and gpu_stage["name"] not in collected
        problems = [f"GPU run: {p}" for p in check(gpu_stage, collect)]
        problems += [f"dry run: {p}" for p in check(dry_stage, False)]  # collected when the dry run runs
        problems += compare(gpu_stage, dry_stage)
        print(f"{gpu_stage['name']}: {'ok' if not problems else 'FAILED'}")
        for problem in problems:
            print(f"    {problem}")
        failed += bool(problems)
    print(f"{failed} of {len(gpu)} stages with problems" if failed else f"all {len(gpu)} stages' arguments check")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
