"""The package's shape (no engine): no import cycle between its modules
(function-level imports included, ``TYPE_CHECKING`` ones not), no module
name used in two folders, none of the names the code no longer has, no
citation of an issue number outside the measured history; and the docs'
code map names every module, their tables' cells short."""

from __future__ import annotations

import ast
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("vllm_adaptive_spec", "kernels")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(path): path for package in PACKAGES for path in (ROOT / package).rglob("*.py")}


def _type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def imports(tree: ast.AST, known: set[str]) -> set[str]:
    """The package modules a module imports, anywhere but under ``if TYPE_CHECKING``."""
    found: set[str] = set()
    stack = [tree]
    while stack:
        node = stack.pop()
        if _type_checking(node):
            continue
        stack.extend(ast.iter_child_nodes(node))
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                target = f"{node.module}.{alias.name}"
                found.add(target if target in known else node.module)
    return found & known


def cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``graph``, or None."""
    state: dict[str, int] = {}  # 1: on the path, 2: done

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (found := visit(nxt, path + [nxt])):
                return found
        state[node] = 2
        return None

    for start in sorted(graph):
        if start not in state and (found := visit(start, [start])):
            return found
    return None


def import_graph() -> dict[str, set[str]]:
    known = modules()
    return {name: imports(ast.parse(path.read_text()), set(known)) - {name} for name, path in known.items()}


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    assert "vllm_adaptive_spec.adapter.tree_scheduler" in graph["vllm_adaptive_spec.adapter.runner"]
    assert cycle(graph) is None, " -> ".join(cycle(graph))


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def test_no_module_name_in_two_folders():
    names: dict[str, list[Path]] = {}
    for folder in (*PACKAGES, "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py":
                names.setdefault(path.name, []).append(path.relative_to(ROOT))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}


def test_names_the_code_no_longer_has():
    """The step's second copies and code only tests ran: gone for good."""
    gone = ("WidthBudget", "verify_step", "greedy_targets", "sampled_targets", "row_positions", "StepOutput",
            "plain_decode_step", "WholeTreeDrafter", "select_within_width", "uniform_tree_rows")
    text = "\n".join(path.read_text() for path in modules().values())
    assert [name for name in gone if name in text] == []


# Measured history, dated by session; everything else a reader reads without the issues.
HISTORY = {"benchmarks/RESULTS.md"}
ISSUE_CITATION = re.compile(r"\b[Ii]ssues?\s+#?\d+")


def test_no_code_or_doc_cites_an_issue_number():
    """The issues are not in the repository, so code, tests, scripts and docs
    say what a citation meant instead of citing it."""
    listed = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    cited = [path for path in listed.split()
             if path.endswith((".py", ".md", ".sh", ".txt", ".ini", ".toml", "Makefile")) and path not in HISTORY
             and (ROOT / path).is_file() and ISSUE_CITATION.search((ROOT / path).read_text(errors="replace"))]
    assert cited == []


def test_the_code_map_names_every_module_and_nothing_gone():
    """docs/design.md's "Where the code is" names every module file of the
    package and the kernels, and every file it names exists."""
    text = (ROOT / "docs" / "design.md").read_text().split("## Where the code is", 1)[1]
    files = {path.name for path in modules().values() if path.name != "__init__.py"}
    named = set(re.findall(r"`(\w+\.py)`", text))
    assert sorted(files - named) == []
    assert sorted(named - files) == []


def test_doc_tables_keep_cells_short():
    """A table cell a reader can take in at a glance; anything longer is prose below the table."""
    long_cells = [(path.name, number) for path in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]
                  for number, line in enumerate(path.read_text().splitlines(), 1)
                  if line.startswith("|") and max(map(len, line.split("|"))) > 300]
    assert long_cells == []
