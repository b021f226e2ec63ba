"""Every relative link in the README, the docs and the benchmarks' pages
reaches a file, and its anchor a heading there; every committed report a
page names in a code span (``benchmarks/figures/...``) exists. Files and
folders move (results by topic and date); a link left behind fails here."""

from __future__ import annotations

import functools
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FIGURE = re.compile(r"`[^`\n]*?(benchmarks/figures/[\w./-]+)[^`\n]*`")


def pages() -> list[Path]:
    found = [ROOT / "README.md"]
    for folder in ("docs", "benchmarks", "heads"):
        found += sorted(path for path in (ROOT / folder).rglob("*.md") if "out" not in path.relative_to(ROOT).parts)
    return found


def slug(heading: str) -> str:
    """A heading's anchor as GitHub writes it."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower().replace("`", ""))
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


@functools.cache
def anchors(page: Path) -> frozenset[str]:
    """The page's heading anchors (a repeated heading's get ``-1``, ``-2``, ...)."""
    seen: dict[str, int] = {}
    for heading in re.findall(r"^#{1,6} (.*)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), re.M):
        name = slug(heading)
        seen[name] = seen.get(name, -1) + 1
    return frozenset(name if count == 0 else f"{name}-{count}" for name, top in seen.items()
                     for count in range(top + 1))


def broken(page: Path) -> list[str]:
    text = page.read_text()
    body = re.sub(r"```.*?```", "", text, flags=re.S)
    found = []
    for target in LINK.findall(body):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            found.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            found.append(target)
    # A path cut short by a pattern (``-{a,b}``, ``*``) names what starts with it.
    found += [path for path in FIGURE.findall(text) if not any(ROOT.glob(path.rstrip(".") + "*"))]
    return found


def test_every_link_and_named_report_resolves():
    everywhere = {str(page.relative_to(ROOT)): found for page in pages() if (found := broken(page))}
    assert len(pages()) > 20
    assert everywhere == {}


def test_the_checker_finds_a_link_left_behind(tmp_path):
    (tmp_path / "b.md").write_text("# The load budget (`budget/`)\n")
    page = tmp_path / "a.md"
    page.write_text("[ok](b.md#the-load-budget-budget) [gone](c.md) [moved](b.md#the-budget)\n"
                    "`benchmarks/figures/readme/results.md` `benchmarks/figures/before_after/1999-01-01/x.md`\n")
    assert broken(page) == ["c.md", "b.md#the-budget", "benchmarks/figures/before_after/1999-01-01/x.md"]
    assert slug("2026-12-06 · 8539f8e · A tree's layout; CPU only") == "2026-12-06--8539f8e--a-trees-layout-cpu-only"
