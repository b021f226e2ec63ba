"""The benchmarks' report of interleaved rounds (benchmarks/engines.py): the ratio to no
speculation is the median of per-round ratios (each against none's pass in
the same round), counters add up, and every round's greedy tokens are
compared with none's."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks import engines
from benchmarks.report import compare


def _pass(round_index: int, tok_per_s: float, token_ids, accepted: int = 0) -> dict:
    spec = {"drafts": 10 if accepted else 0, "draft_tokens": 40 if accepted else 0, "accepted_tokens": accepted}
    return {"round": round_index, "batch_size": 4, "num_prompts": 2, "wall_s": 1.0, "generated_tokens": 100,
            "prompt_tokens": 50, "tok_per_s": tok_per_s, "spec": spec, "tree": {}, "by_category": {},
            "token_ids": token_ids}


def test_interleaved_rounds_report_the_median_of_paired_ratios():
    same, other = [[1, 2], [3, 4]], [[1, 2], [3, 5]]
    base = [_pass(0, 10.0, same), _pass(2, 20.0, same), _pass(1, 40.0, same)]
    passes = [_pass(1, 60.0, same, 5), _pass(0, 11.0, same, 5), _pass(2, 40.0, other, 5)]
    row = compare("m", True, passes, base, None, ["p0", "p1"])
    assert row["ratio_per_round"] == pytest.approx([1.1, 1.5, 2.0])  # rounds paired by index, not by order given
    assert row["ratio_vs_none"] == pytest.approx(1.5)
    assert row["tok_per_s"] == pytest.approx(40.0)
    assert row["tau"] == pytest.approx(1 + 15 / 30)
    assert row["same_as_none"] == [5, 6] and row["differing_prompts"] == ["p1"]


def test_a_single_pass_is_reported_as_is():
    base, run = [_pass(0, 10.0, [[1]])], [_pass(0, 12.0, [[1]], 3)]
    row = compare("m", True, run, base, None, ["p0"])
    assert row["ratio_vs_none"] == pytest.approx(1.2) and row["same_as_none"] == [1, 1]
    assert "rounds" not in row


def test_floor_sweep_reports_each_groups_control_without_a_floor():
    """A group's control (a second engine without speculation) is shown with
    its ratio and no floor or verdict; a cell below its floor is marked."""
    from benchmarks import floor_sweep

    control = floor_sweep.summarize("control/group1", {"batch_size": 8, "ratio_vs_none": 0.93,
                                                       "same_as_none": [32, 32]})
    cell = floor_sweep.summarize("eagle3/c2t/N32", {"batch_size": 8, "ratio_vs_none": 0.94, "same_as_none": [32, 32],
                                                   "tree": {"probes": 2, "paused": 1022, "draft_passes": 8}})
    assert control["floor"] is None and cell["floor"] == 0.95
    report = {"settings": {"max_tokens": 256, "dtype": "float32", "rounds": 2, "prompts_per_batch": [16]},
              "vllm_version": "0.32.0", "machine": {"cpu_model": "cpu", "nproc": 2}, "timestamp": "now", "rows": [control, cell], "elapsed_s": 1.0}
    lines = floor_sweep.markdown(report).splitlines()
    assert "| control/group1 | 8 | 0.93 | | | | | | | 32/32 |" in lines
    assert "| eagle3/c2t/N32 | 8 | 0.94 | 0.95 | **no** | 0% | 2 | 1022 | 8 | 32/32 |" in lines


def test_floor_sweep_reads_lockstep_passes_as_one_row():
    """Lockstep passes of a cell at one batch size: the median of the passes'
    ratios, greedy equality summed over passes, the plugin's counters summed,
    and the share of request steps that verified a tree."""
    from benchmarks import floor_sweep

    def run(ratio, same, trees, accepted):
        return {"ratio": ratio, "same": [same, 8], "tokens": 100, "wall_s": 2.0,
                "tree": {"trees_verified": trees, "tokens_accepted": accepted, "probes": 1, "paused": 40}}

    row = floor_sweep.lockstep_row([run(0.97, 8, 10, 20), run(1.01, 7, 30, 20), run(0.99, 8, 0, 0)])
    assert row["ratio_vs_none"] == pytest.approx(0.99) and row["ratio_per_round"] == [0.97, 1.01, 0.99]
    assert row["same_as_none"] == [23, 24] and row["tok_per_s"] == pytest.approx(50.0)
    assert row["tree"] == {"trees_verified": 40, "tokens_accepted": 40, "probes": 3, "paused": 120}
    assert row["drafting_share"] == pytest.approx(40 / (300 - 40))
    cell = floor_sweep.summarize("eagle3/talon/N32", {**row, "batch_size": 8})
    assert (cell["ratio"], cell["probes"], cell["paused_steps"], cell["same"]) == (pytest.approx(0.99), 3, 120, [23, 24])


def test_floor_sweep_runs_merge_into_one_table_and_refuse_different_workloads():
    """Runs of one sweep in several invocations read as one report: every
    row kept, each run's group controls told apart by the run's name, the
    cells together, a cell measured again replaced by the later run's rows;
    runs whose workloads differ are refused, naming the setting."""
    from benchmarks import floor_sweep

    def report(cell, ratio, max_tokens=256):
        settings = {"cells": {cell: {"method": "adaptive_tree"}}, "batch_sizes": [1, 8], "prompts_per_batch": [2, 16],
                    "rounds": 2, "engine_layout": "lockstep", "max_tokens": max_tokens, "dtype": "float32",
                    "prompt_ids": ["a", "b"]}
        rows = [floor_sweep.summarize("control/group1", {"batch_size": 1, "ratio_vs_none": 1.01, "same_as_none": [2, 2]}),
                floor_sweep.summarize(cell, {"batch_size": 1, "ratio_vs_none": ratio, "same_as_none": [2, 2]})]
        return {"timestamp": "t", "vllm_version": "0.32.0", "machine": {"cpu_model": "cpu", "nproc": 2},
                "settings": settings, "rows": rows, "elapsed_s": 10.0}

    merged = floor_sweep.merge({"fs_a": report("eagle3/talon/N8", 0.97), "fs_b": report("retrieval/chain/N60", 1.2)})
    assert [r["cell"] for r in merged["rows"]] == ["control/fs_a/group1", "eagle3/talon/N8",
                                                   "control/fs_b/group1", "retrieval/chain/N60"]
    assert set(merged["settings"]["cells"]) == {"eagle3/talon/N8", "retrieval/chain/N60"}
    assert merged["elapsed_s"] == 20.0
    lines = floor_sweep.markdown(merged).splitlines()
    assert "| control/fs_b/group1 | 1 | 1.01 | | | | | | | 2/2 |" in lines
    assert "| retrieval/chain/N60 | 1 | 1.20 | 0.97 | yes | 0% | 0 | 0 | 0 | 2/2 |" in lines
    rerun = floor_sweep.merge({"fs_a": report("eagle3/talon/N8", 0.97), "fs_b": report("eagle3/talon/N8", 1.01)})
    assert [(r["cell"], r["ratio"]) for r in rerun["rows"]] == [
        ("control/fs_a/group1", 1.01), ("control/fs_b/group1", 1.01), ("eagle3/talon/N8", 1.01)]
    with pytest.raises(ValueError, match="'fs_a' and 'fs_c' differ in 'max_tokens': 256 against 128"):
        floor_sweep.merge({"fs_a": report("eagle3/talon/N8", 0.97), "fs_c": report("eagle3/talon/N60", 0.97, 128)})


def test_floor_sweep_merge_refuses_a_directory_without_a_sweep(tmp_path, capsys):
    from benchmarks import floor_sweep

    with pytest.raises(SystemExit):
        floor_sweep.main(["--merge", str(tmp_path / "fs_a"), "--out", str(tmp_path / "merged")])
    assert f"--merge: {tmp_path / 'fs_a' / 'floor_sweep.json'} not found" in capsys.readouterr().err
    assert not (tmp_path / "merged").exists()


def test_one_spec_parser_takes_labelled_configs_and_null_and_refuses_others():
    import argparse

    from benchmarks.options import parse_spec

    assert parse_spec('tree={"method": "adaptive_tree"}') == ("tree", {"method": "adaptive_tree"})
    assert parse_spec('{"method": "ngram"}') == ("speculation", {"method": "ngram"})
    assert parse_spec("control=null") == ("control", None)
    for bad in ("tree", "={}", "tree={not json", "tree=[1]"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_spec(bad)


def test_before_after_refuses_an_unknown_vllm_method_naming_the_valid_ones(capsys):
    from benchmarks import before_after

    with pytest.raises(SystemExit):
        before_after.main(["--before", ".", "--spec", "t={}", "--vllm-methods", "ngram,medusa"])
    said = capsys.readouterr().err
    assert "--vllm-methods: unknown medusa; valid: ngram, suffix, eagle3" in said


def test_cold_start_reports_the_first_pass_against_the_warm_ones_and_refuses_one_pass():
    from benchmarks import cold_start

    row = {"label": "hybrid", "cold": 1.25, "passes": [
        {"seconds": 12.5, "new_shapes": 130, "counters": {"draft_passes": 40}},
        {"seconds": 10.0, "new_shapes": 5, "counters": {"draft_passes": 4}}]}
    report = {"settings": {"num_prompts": 32, "prompts": "p.jsonl", "batch": 32, "max_tokens": 96, "passes": 2},
              "vllm_version": "0.32.0", "machine": {"cpu_model": "cpu", "nproc": 2}, "rows": [row]}
    assert "| hybrid | 12.50 / 10.00 | 1.25x | 130 / 5 | 40 / 4 |" in cold_start.markdown(report).splitlines()
    with pytest.raises(SystemExit):
        cold_start.main(["--passes", "1"])


def test_serve_load_reads_options_from_a_command_line():
    """How a server's environment follows its arguments (the uni executor)."""
    from benchmarks.serving import servers

    assert servers.option(["--distributed-executor-backend", "uni"], "--distributed-executor-backend") == "uni"
    assert servers.option(["--distributed-executor-backend=mp"], "--distributed-executor-backend") == "mp"
    assert servers.option(["--served-model-name", "uni"], "--distributed-executor-backend") is None
    assert servers.option(["--seed", "0", "--seed", "1"], "--seed") == "1"


def test_serve_load_names_the_servers_allocator(monkeypatch):
    from benchmarks import serve_load

    monkeypatch.setenv("LD_PRELOAD", "/usr/lib/libtcmalloc_minimal.so.4")
    assert serve_load.allocator() == "tcmalloc (LD_PRELOAD)"
    monkeypatch.delenv("LD_PRELOAD")
    assert serve_load.allocator() == "the C library's malloc"


def test_serve_load_caps_onednn_primitive_cache_in_every_server_environment(monkeypatch):
    from benchmarks.serving import servers

    monkeypatch.delenv("ONEDNN_PRIMITIVE_CACHE_CAPACITY", raising=False)
    env = servers.server_env([], 128)
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == "128" and env["VLLM_SERVER_DEV_MODE"] == "1"
    assert "ONEDNN_PRIMITIVE_CACHE_CAPACITY" not in servers.server_env([], 0)
    assert "VLLM_ENABLE_V1_MULTIPROCESSING" not in env
    assert servers.server_env(["--distributed-executor-backend", "uni"], 0)["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"


def test_serve_load_warmup_gives_every_weight_more_row_counts_than_its_cache_keeps():
    from benchmarks.serving import workload

    jobs = workload.warmup_jobs(40, 2048, "model")
    lengths = [len(job.body["prompt"]) for job in jobs]
    assert len(set(lengths)) == 40 > 32  # vLLM's CPU build keeps 32 primitives a weight
    assert min(lengths) == 8 and max(lengths) == 512
    # No two prompts share a first block, so no prefix-cache hit shortens a prefill.
    assert len({tuple(job.body["prompt"][:8]) for job in jobs}) == 40
    assert all(job.kind == "warmup" and not job.stream and job.body["temperature"] == 0.0 for job in jobs)


def test_serve_load_batch_warmup_draws_the_mix_from_held_out_prompts_only():
    from benchmarks.serving import workload
    from vllm_adaptive_spec.prompts import load_prompts

    jobs = workload.batch_warmup_jobs(64, 2048, "model")
    assert len(jobs) == 64 and all(job.kind == "warmup" and job.index < 0 for job in jobs)
    assert any(job.stream for job in jobs) and any(job.body.get("n") == 2 for job in jobs)
    measured = [p.messages[-1]["content"] for p in load_prompts()]
    held_out = [p.messages[-1]["content"] for p in load_prompts(workload.HELDOUT)]
    # Every question but the structured-output requests' fixed one.
    texts = [job.body["messages"][-1]["content"] if job.endpoint == "chat" else job.body["prompt"]
             for job in jobs if "response_format" not in job.body]
    assert not any(question in text for text in texts for question in measured)
    assert all(any(question[:200] in text for question in held_out) for text in texts)


FAKE_WORKER = """
import json, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
from benchmarks import engine_worker
job = json.loads(Path(sys.argv[2]).read_text())
engine_worker.wait_for_turn(job, "start")
gate = Path(job["gate_dir"])
(gate / (job["label"] + ".up")).touch()
deadline = time.monotonic() + {wait_s}
while len(list(gate.glob("*.up"))) < {engines_n} and time.monotonic() < deadline:
    time.sleep(0.02)
seen = len(list(gate.glob("*.up")))
engine_worker.signal_done(job, "start")
result = {{"runs": []}}
for b in job["batch_sizes"]:
    engine_worker.wait_for_turn(job, "b%d-r0" % b)
    result["runs"].append({{"batch_size": b, "engines_up": seen}})
    Path(job["result_path"]).write_text(json.dumps(result))
    engine_worker.signal_done(job, "b%d-r0" % b)
"""


@pytest.mark.parametrize("together", [True, False])
def test_interleaved_engines_start_one_by_one_or_together(tmp_path, together):
    repo = str(Path(engines.__file__).parent.parent)
    script = tmp_path / "fake_worker.py"
    script.write_text(FAKE_WORKER.format(repo=repo, wait_s=1.0 if not together else 20.0, engines_n=3))
    jobs = {name: {"batch_sizes": [1, 8]} for name in ("none", "a", "b")}
    done = engines.run_interleaved(jobs, tmp_path / "work", 1, 60.0, log=lambda line: None,
                                   script_for=lambda name: script, start_together=together)
    for name, result in done.items():
        assert "error" not in result, result
        assert [run["batch_size"] for run in result["runs"]] == [1, 8]
    # One by one, the k-th engine starts beside the k - 1 before it; together, all three are up at once.
    seen = sorted(result["runs"][0]["engines_up"] for result in done.values())
    assert seen == ([3, 3, 3] if together else [1, 2, 3])


def test_a_run_that_cannot_fit_its_engines_says_so_before_it_starts(demo_model):
    """Five engines of 16 requests of 4,096 tokens each, all at once, on a
    machine with 8 GiB available: refused, naming each engine's need and what
    the machine has; one at a time, or with room, it may start."""
    job = {"model": demo_model, "dtype": "float32", "max_model_len": 4096, "max_num_seqs": 16,
           "speculative_config": None}
    jobs = {f"m{k}": job for k in range(5)}
    problem = engines.memory_problem(jobs, together=True, available=8 * 2**30)
    assert problem is not None and "m0 " in problem and "8.0 GiB available" in problem
    assert "1 of these 5 engines fit together" in problem and "--engine-per method" in problem
    assert engines.memory_problem(jobs, together=False, available=8 * 2**30) is None
    assert engines.memory_problem(jobs, together=True, available=None) is None


def test_a_failed_engine_is_reported_with_vllms_own_last_error_line():
    """vLLM's worker lines carry a rank prefix and its log lines a level, time
    and source; the error line is found behind either, and the last one wins."""
    tail = [
        "INFO 12-01 04:35:50 [gpu_model_runner.py:2100] Loading model",
        "ERROR 12-01 04:35:51 [core.py:708] RuntimeError: first failure",
        "[rank0]: Traceback (most recent call last):",
        '[rank0]:   File "/x/worker.py", line 3, in <module>',
        "[rank0]: ValueError: Available memory on node 0 (2.6/23.54 GiB) on kv cache allocation "
        "is less than requested memory for kv (5.03 GiB)",
        "[rank0]:[W1201 04:35:52] ProcessGroupGloo destroyed",
    ]
    assert engines.last_error_line(tail) == (
        "ValueError: Available memory on node 0 (2.6/23.54 GiB) on kv cache allocation "
        "is less than requested memory for kv (5.03 GiB)")
    assert engines.last_error_line(tail[:2]) == "RuntimeError: first failure"
    assert engines.last_error_line(["loading", "done"]) is None


def test_the_memory_check_counts_what_an_engine_measurably_takes(demo_model):
    """Four engines of 64 requests of 1,600 tokens (long prompts) in float32 at
    once on a machine with 23.5 GiB: the KV caches alone (5 GiB each) would pass, the
    engines as they run (KV, weights in float32, the runtime) do not; the
    refusal names how many fit. One engine more than its KV and file weights."""
    job = {"model": demo_model, "dtype": "float32", "max_model_len": 1600, "max_num_seqs": 64,
           "speculative_config": None}
    from vllm_adaptive_spec.kv_cache_size import kv_cache_bytes
    kv = kv_cache_bytes(demo_model, max_model_len=1600, max_num_seqs=64, dtype="float32")
    assert engines.engine_bytes(job) >= kv + engines.ENGINE_RUNTIME_BYTES
    jobs = {f"m{k}": job for k in range(4)}
    assert 4 * kv < 23.5 * 2**30
    problem = engines.memory_problem(jobs, together=True, available=int(23.5 * 2**30))
    assert problem is not None and "fit together" in problem
