"""The serve-load report: per-server summaries (outcomes, latency
percentiles, memory), the greedy answers compared with the server without
speculation, the Markdown table and the plot."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks.report import pyplot
from benchmarks.serving.workload import PLAIN, Job, Outcome


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    ordered = sorted(values)

    def at(q: float) -> float:
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]

    return {"p50": at(0.5), "p90": at(0.9), "p99": at(0.99), "max": ordered[-1]}


def summarize(run: dict, jobs: list[Job]) -> dict:
    outcomes = [Outcome(**o) for o in run["outcomes"]]
    bad = {j.index for j in jobs if j.kind == "bad"}
    lost = [o.index for o in outcomes if o.index not in bad and o.status != 200 and not o.disconnected]
    server_errors = [o.index for o in outcomes if o.status is not None and o.status >= 500]
    wrongly_accepted = [o.index for o in outcomes if o.index in bad and o.status == 200]
    incomplete = [o.index for o in outcomes if o.status == 200 and not o.disconnected
                  and (not o.finish_reasons or None in o.finish_reasons)]
    tokens = sum(len(ids) for o in outcomes for ids in o.token_ids)
    itl = [b - a for o in outcomes for a, b in zip(o.token_times, o.token_times[1:])]
    samples = [(t, total, api) for t, total, api in run["memory"] if total]
    finished = sorted(o.finished for o in outcomes)

    def memory_after(answers: int) -> tuple[float, float] | tuple[None, None]:
        """GiB of the whole server and of its API server process at the first
        sample after the server's own ``answers``-th answer."""
        at = finished[min(answers, len(finished)) - 1] - run["started"]
        after = [(total / 2**30, api / 2**30) for t, total, api in samples if t >= at]
        return after[0] if after else (None, None)

    (at_100, api_100), (at_half, api_half) = memory_after(100), memory_after(len(finished) // 2)
    at_end, api_end = (samples[-1][1] / 2**30, samples[-1][2] / 2**30) if samples else (None, None)

    return {
        "requests": len(outcomes), "lost": lost, "server_errors": server_errors, "bad_requests_refused":
            len(bad) - len(wrongly_accepted), "bad_requests_accepted": wrongly_accepted, "incomplete": incomplete,
        "disconnected": sum(o.disconnected for o in outcomes), "alive": run["alive"], "wall_s": run["wall_s"],
        "tokens": tokens, "tok_per_s": tokens / run["wall_s"],
        "ttft_s": _percentiles([o.first_token - o.started for o in outcomes if o.first_token]),
        "itl_s": _percentiles(itl), "e2e_s": _percentiles([o.finished - o.started for o in outcomes if o.status == 200]),
        "warmup_requests": run["warmup_requests"], "batch_warmup_requests": run.get("batch_warmup_requests", 0),
        "memory_gib_ready": run["memory_ready"] / 2**30,
        "memory_gib_warm": run["memory_warm"] / 2**30,
        "memory_gib_after_100": at_100, "memory_gib_half": at_half, "memory_gib_end": at_end,
        "api_server_gib_after_100": api_100, "api_server_gib_half": api_half, "api_server_gib_end": api_end,
        "counters": run["counters"], "tree_stats": run.get("tree_stats"),
    }


def drafted_share(tree_stats: list[dict] | None) -> str:
    """Per kind of sampling (``adapter/drafted_share``), the finished
    requests of two tokens or more that had a tree verified, of all of
    them, and those that had grammar-forced tokens verified (rank 0's
    count: every rank verifies the same trees)."""
    kinds = (tree_stats or [{}])[0].get("drafted_by_kind") or {}

    def share(kind: str, counts: dict) -> str:
        forced = f" (grammar-forced tokens: {counts['forced']})" if counts.get("forced") else ""
        return f"{kind} {counts['drafted']}/{counts['requests']}{forced}"

    return ", ".join(share(kind, c) for kind, c in kinds.items() if c["requests"]) or "none"


def greedy_comparison(plain: dict, spec: dict, jobs: list[Job]) -> dict:
    """Greedy requests answered completely by both servers: token ids equal?
    And every request neither client left: the same status from both?"""
    first = {o["index"]: o for o in plain["outcomes"]}
    second = {o["index"]: o for o in spec["outcomes"]}
    compared, differ, status_differs = 0, [], []
    for job in jobs:
        a, b = first[job.index], second[job.index]
        if a["status"] != b["status"] and not (a["disconnected"] or b["disconnected"]):
            status_differs.append(job.index)
        if not job.greedy or a["status"] != 200 or b["status"] != 200 or a["disconnected"] or b["disconnected"]:
            continue
        compared += 1
        if a["token_ids"] != b["token_ids"]:
            differ.append(job.index)
    return {"compared": compared, "differ": differ, "status_differs": status_differs}


def markdown(report: dict) -> str:
    servers = report["servers"]
    labels = list(servers)
    lines = [f"# Server under load: {report['requests']} requests, concurrency {report['concurrency']}, "
             f"{report['blocks']} interleaved blocks", "", report["note"], ""]
    lines += [f"- `{label}`: `{json.dumps(report['spec_configs'][label])}`" for label in labels if label != PLAIN]
    lines += ["", "| | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]

    def row(name, fn):
        lines.append(f"| {name} | " + " | ".join(str(fn(servers[label])) for label in labels) + " |")

    row("lost (no complete answer, not a disconnect)", lambda s: len(s["lost"]))
    row("server errors (5xx)", lambda s: len(s["server_errors"]))
    row("bad requests refused with 4xx", lambda s: s["bad_requests_refused"])
    row("bad requests accepted", lambda s: len(s["bad_requests_accepted"]))
    row("incomplete answers", lambda s: len(s["incomplete"]))
    row("client disconnects", lambda s: s["disconnected"])
    row("server alive at the end", lambda s: s["alive"])
    row("tok/s (own blocks)", lambda s: f"{s['tok_per_s']:.1f}")
    for metric in ("ttft_s", "itl_s", "e2e_s"):
        row(f"{metric[:-2]} p50 / p90 / p99, s",
            lambda s, m=metric: " / ".join(f"{s[m].get(q, float('nan')):.3f}" for q in ("p50", "p90", "p99")))
    row("memory once up / after the warm-up requests, GiB",
        lambda s: f"{s['memory_gib_ready']:.2f} / {s['memory_gib_warm']:.2f} ({s['warmup_requests']} one at a time, "
                  f"{s['batch_warmup_requests']} together)")
    row("memory after its 100th answer / half its answers / at the end, GiB",
        lambda s: f"{s['memory_gib_after_100'] or 0:.2f} / {s['memory_gib_half'] or 0:.2f} / {s['memory_gib_end'] or 0:.2f}")
    row("of which the API server process, GiB",
        lambda s: f"{s['api_server_gib_after_100'] or 0:.2f} / {s['api_server_gib_half'] or 0:.2f} / "
                  f"{s['api_server_gib_end'] or 0:.2f}")
    row("preemptions", lambda s: int(s["counters"].get("vllm:num_preemptions_total", 0)))
    row("prefix-cache hits, tokens", lambda s: int(s["counters"].get("vllm:prefix_cache_hits_total", 0)))
    row("draft tokens / accepted", lambda s: f"{int(s['counters'].get('vllm:spec_decode_num_draft_tokens_total', 0))} / "
        f"{int(s['counters'].get('vllm:spec_decode_num_accepted_tokens_total', 0))}")
    lines.append("")
    for label in labels[1:]:
        ratio, greedy = report["ratios"][label], report["greedy"][label]
        lines.append(f"- `{label}`: tok/s over no speculation **{ratio['total']:.2f}x** (per-block median "
                     f"{ratio['median']:.2f}x, range {min(ratio['blocks']):.2f}-{max(ratio['blocks']):.2f}); greedy "
                     f"requests compared: {greedy['compared']}, differing: {len(greedy['differ'])}; requests with "
                     f"another status than without speculation: {len(greedy['status_differs'])}; plugin state once "
                     f"idle (per rank): {[r.get('requests_held') for r in servers[label].get('tree_stats') or []]}; "
                     f"requests that received trees: {drafted_share(servers[label].get('tree_stats'))}")
    return "\n".join(lines) + "\n"


def plot(report: dict, out: Path) -> list[Path]:
    """Latency, tok/s and memory over the run, one line per server (from the
    report's ``runs``)."""
    plt = pyplot()
    if plt is None:
        return []
    runs = report["runs"]
    fig, (latency, throughput, memory) = plt.subplots(3, 1, figsize=(9, 8), sharex=True)
    for label, run in runs.items():
        outcomes = [o for o in run["outcomes"] if o["status"] == 200]
        ends = [o["finished"] - run["started"] for o in outcomes]
        latency.scatter(ends, [o["finished"] - o["started"] for o in outcomes], s=4, label=label)
        window = 10.0
        bins = int(max(ends, default=0.0) // window) + 1
        tokens = [0.0] * bins
        for o, end in zip(outcomes, ends):
            tokens[min(int(end // window), bins - 1)] += sum(len(ids) for ids in o["token_ids"])
        throughput.plot([window * (i + 0.5) for i in range(bins)], [t / window for t in tokens], label=label)
        samples = [(t, m / 2**30) for t, m, _ in run["memory"] if m]
        memory.plot([t for t, _ in samples], [m for _, m in samples], label=label)
    latency.set_ylabel("end-to-end latency, s")
    throughput.set_ylabel("tok/s (10 s windows)")
    memory.set_ylabel("resident memory, GiB")
    memory.set_xlabel("seconds into the run (the servers take turns, block by block)")
    latency.legend()
    fig.suptitle(f"{report['requests']} requests, concurrency {report['concurrency']}")
    fig.tight_layout()
    fig.savefig(out / "serve_load.png", dpi=110)
    plt.close(fig)
    return [out / "serve_load.png"]
