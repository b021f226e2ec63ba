"""The README's results are the file ``vllm-adaptive-spec bench readme``
wrote, and that file is what the committed runs say (no engine)."""

from __future__ import annotations

import pytest

from benchmarks import readme_results
from benchmarks.readme_results import END, OUT, README, START


def test_readme_table_is_the_file_the_command_wrote():
    assert readme_results.readme_block(README.read_text()) == (OUT / "results.md").read_text()


def test_the_file_is_what_the_committed_runs_measured():
    """Redrawn from the two runs' reports, the table is the committed one: a
    number edited in either file fails here or above."""
    reports = readme_results.load_reports(OUT)
    written = (OUT / "results.md").read_text()
    stamp_line = written.strip().splitlines()[-1]
    redrawn = readme_results.table(reports, readme_results.stamp_of(reports))
    assert redrawn.strip().splitlines()[:-1] == written.strip().splitlines()[:-1]
    assert redrawn.strip().splitlines()[-1] == stamp_line


def test_an_edited_number_is_caught():
    text = README.read_text()
    block = readme_results.readme_block(text)
    number = next(word for word in block.split() if word.endswith("x") and word[:-1].replace(".", "").isdigit())
    edited = text.replace(number, f"{float(number[:-1]) + 0.5:.2f}x", 1)
    assert readme_results.readme_block(edited) != (OUT / "results.md").read_text()


def test_the_block_is_replaced_between_its_markers_only():
    text = f"intro\n{START}\nold table\n{END}\noutro\n"
    assert readme_results.with_block(text, "new table\n") == f"intro\n{START}\nnew table\n{END}\noutro\n"
    with pytest.raises(SystemExit, match="no results markers"):
        readme_results.with_block("no markers here\n", "table\n")


def test_the_runs_are_the_readmes_workload():
    """Held-out prompts, interleaved in 2 rounds, batch 1, 8 and 64, none,
    ngram, suffix and the default config, at both answer lengths."""
    for tokens, report in readme_results.load_reports(OUT).items():
        settings = report["settings"]
        assert settings["max_tokens"] == tokens
        assert settings["batch_sizes"] == list(readme_results.BATCH_SIZES)
        assert settings["engine_per"] == "interleaved" and settings["rounds"] == 2
        assert settings["prompts"].endswith("heldout_prompts.jsonl")
        assert {row["method"] for row in report["results"]} == {"none", *readme_results.METHODS}
