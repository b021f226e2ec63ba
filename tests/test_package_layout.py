"""The package's shape (no engine): no import cycle between its modules or its
folders (function-level and ``TYPE_CHECKING`` imports included), no module
name used in two folders, no tracked text file that cites an issue number or
a work period by its count (the measured history included); and the docs'
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


def imports(tree: ast.AST, known: set[str]) -> set[str]:
    """The package modules a module imports, anywhere (``TYPE_CHECKING``
    blocks and functions included: a loop of design is one all the same)."""
    found: set[str] = set()
    for node in ast.walk(tree):
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


def folder_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """``graph`` between the package's folders and top-level modules
    (``vllm_adaptive_spec.trees``, ``kernels.tree_gating``, ...)."""
    def folder(name: str) -> str:
        return ".".join(name.split(".")[:2])

    folders: dict[str, set[str]] = {folder(name): set() for name in graph}
    for name, targets in graph.items():
        folders[folder(name)] |= {folder(t) for t in targets} - {folder(name)}
    return folders


def test_imports_between_folders_run_one_way():
    """A folder never imports one that imports it back, even through
    others: the core reads from the bottom up (trees, then policies and the
    budget, drafters, the step, the adapter)."""
    folders = folder_graph(import_graph())
    assert "vllm_adaptive_spec.trees" in folders["vllm_adaptive_spec.step"]
    assert folders["vllm_adaptive_spec.trees"] == set()
    assert cycle(folders) is None, " -> ".join(cycle(folders))
    planted = folder_graph({"p.trees.growth": {"p.policies.base"}, "p.policies.base": {"p.trees.candidates"},
                            "p.trees.candidates": set()})
    assert cycle(planted) == ["p.policies", "p.trees", "p.policies"]


def test_imports_include_type_checking_and_function_level_ones():
    source = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from a.b import C\ndef f():\n    import a.d\n"
    assert imports(ast.parse(source), {"a.b", "a.d"}) == {"a.b", "a.d"}


def test_the_cycle_finder_finds_a_cycle():
    assert cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert cycle({"a": {"b"}, "b": set()}) is None


def vllm_internals(tree: ast.AST) -> set[str]:
    """The vLLM modules a module imports beyond the public top level (``from vllm import LLM``)."""
    found = {alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    found |= {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    return {name for name in found if name.startswith("vllm.")}


def test_every_vllm_internal_is_imported_in_the_adapter_and_the_step_imports_none():
    """vLLM's internals are touched in ``adapter/`` alone; the engine step
    (``step/``) and the core below it import neither vLLM nor the adapter
    (only the plugin's entry point installs it)."""
    known = modules()
    outside = {name: sorted(found) for name, path in known.items() if not name.startswith("vllm_adaptive_spec.adapter")
               and (found := vllm_internals(ast.parse(path.read_text())))}
    assert outside == {}
    graph = import_graph()
    into_adapter = {name: sorted(t for t in targets if t.startswith("vllm_adaptive_spec.adapter"))
                    for name, targets in graph.items()
                    if not name.startswith("vllm_adaptive_spec.adapter") and name != "vllm_adaptive_spec.plugin"}
    assert {name: found for name, found in into_adapter.items() if found} == {}
    assert vllm_internals(ast.parse("from vllm import LLM\nfrom vllm.config import X\nimport vllm.utils")) == {
        "vllm.config", "vllm.utils"}


def test_no_module_name_in_two_folders():
    names: dict[str, list[Path]] = {}
    for folder in (*PACKAGES, "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            if path.name != "__init__.py":
                names.setdefault(path.name, []).append(path.relative_to(ROOT))
    assert not {name: paths for name, paths in names.items() if len(paths) > 1}


# An issue's number, or a work period's count (by ordinal, by number, relative to the current one,
# or as a name's suffix): neither the issues nor the work periods are in the repository, so a reader
# could not follow one; a file says what was meant, or the date. The word alone, an HTTP session or
# pytest's session fixture are no citation. (This file spells its examples in pieces.)
_ORDINAL = (r"(?:(?:twenty|thirty|forty|fifty|sixty|seventy|eighty|ninety)-)?"
            r"(?:first|second|third|fourth|fifth|sixth|seventh|eighth|ninth)"
            r"|tenth|eleventh|twelfth|(?:thir|four|fif|six|seven|eigh|nine)teenth"
            r"|(?:twen|thir|for|fif|six|seven|eigh|nine)tieth|\d+(?:st|nd|rd|th)")
CITATION = re.compile(
    rf"\b(?:{_ORDINAL})(?:(?:\s*,\s*|\s+(?:and|or|to)\s+)(?:{_ORDINAL}))*\s+sessions?\b"  # by ordinal
    r"|\bsessions?\s*#?\d"  # by number
    r"|\b(?:this|last|previous|next|earlier|later|prior)\s+sessions?\b(?!\s+(?:fixture|token|cookie|scope|id)\b)"
    r"|(?<![a-z])issues?[\s_#-]*\d"  # an issue's number, spaced or joined
    r"|(?<![\w&/#])#\d{2,4}(?![\w-])"  # a bare issue number
    r"|(?<=[a-z0-9])[_-]s\d{2}(?![a-z0-9])",  # a count as a name's suffix
    re.IGNORECASE)


def citations(text: str) -> list[str]:
    """The issue numbers and work-period counts ``text`` cites."""
    return [match.group(0) for match in CITATION.finditer(text)]


def tracked_text_files() -> dict[str, str]:
    """Every file git tracks that exists and is text (no NUL byte), by path."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    texts = {}
    for name in listed.decode().split("\0"):
        path = ROOT / name
        if name and path.is_file() and b"\0" not in (data := path.read_bytes()):
            texts[name] = data.decode("utf-8", errors="replace")
    return texts


def test_no_code_or_doc_cites_an_issue_number():
    """Every tracked text file (code, tests, scripts, docs, the measured
    history and the committed reports) says what a citation of an issue or a
    work period meant, or its date, instead of citing it."""
    texts = tracked_text_files()
    assert "README.md" in texts and "docs/design.md" in texts
    cited = {path: found[:3] for path, text in texts.items() if (found := citations(text))}
    assert cited == {}


def test_the_citation_check_finds_what_it_is_for():
    s, i = "session", "issue"
    planted = [f"in the thirty-first {s}", f"the 38th {s}", f"the eighth and tenth {s}s' profiles",
               f"forty-third {s}", f"{s} 7", f"{s.title()} 27's run", f"the previous {s}", f"last {s}'s",
               f"{i} 12", f"{i.title()} 53's bound", f"{i} #" + "53", f"{i}53", "see #" + "53.",
               "figures/before_after_" + "s31", "before_after_" + "s35_draft_passes", f"floor_sweep_{i}53_a"]
    assert [text for text in planted if not citations(text)] == []
    ordinary = [f"the {s} token", f"a 2-{s} run", f"an HTTP {s}", s, s + "s", f"a {s} fixture",
                f"the {i} this fixes", "none #2", "aws_s3", "bf16", "tissue 5", "2026-11-29",
                "[entry](history.md#2026-11-29--815822c--the-default-retrieval-tree)"]
    assert [text for text in ordinary if citations(text)] == []


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
