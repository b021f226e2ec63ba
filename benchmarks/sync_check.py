"""How often the host waits for the GPU per engine step, per method: a tree step may
synchronise no more than vLLM's own.

PyTorch's sync debug mode (``torch.cuda.set_sync_debug_mode("warn")``)
warns at every synchronising CUDA call (``item``, ``tolist``, ``nonzero``,
a pageable copy, ...). Each method's engine runs in this process (vLLM's
engine core and worker in-process), decodes ``--batch-size`` greedy requests
for a warm-up, then ``--steps`` engine steps with the mode on; the table gives
the synchronising calls per step and the Python lines that made the most. The plugin adds no synchronisation when its
steps count no more than ``none-v1-sync`` (vLLM without speculation on the
plugin's runner and scheduling); a model drafter's tree (``eagle3-N``) is
compared with vLLM's own EAGLE-3 chain (``vllm-eagle3-K``, the same head).
On a machine without CUDA the mode does nothing and every count is 0.

    .venv/bin/vllm-adaptive-spec bench sync-check --methods none-v1-sync,tree-adaptive-16 --batch-size 8 --out DIR
"""

from __future__ import annotations

import argparse
import os
import warnings
from collections import Counter
from pathlib import Path

from benchmarks import engine_worker, engines, step_profile
from benchmarks.options import add_output, add_workload
from benchmarks.report import write_report


def count_syncs(llm, prompts, params, batch_size: int, steps: int) -> tuple[float, Counter]:
    """Synchronising calls per step over ``steps`` decode steps of
    ``batch_size`` requests, and where they were made (PyTorch files a
    warning at the Python line that called the op)."""
    import torch

    engine = llm.llm_engine
    for k in range(batch_size):
        engine.add_request(str(k), prompts[k % len(prompts)], params)
    for _ in range(3):  # warm-up: prefill and first decode steps
        engine.step()
    done = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if torch.cuda.is_available():
            torch.cuda.set_sync_debug_mode("warn")
        try:
            while done < steps and engine.has_unfinished_requests():
                engine.step()
                done += 1
        finally:
            if torch.cuda.is_available():
                torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    origins = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in syncs)
    engine.abort_request([str(k) for k in range(batch_size)])
    return len(syncs) / max(done, 1), origins


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--methods", default="none-v1-sync,tree-0,tree-adaptive-16")
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--steps", type=int, default=50)
    add_workload(parser, max_tokens=None, prompts=None)  # --max-tokens: default --steps + 16, every request to its end
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--head", default=str(engines.HEAD), help="EAGLE-3 head (eagle3-N, vllm-eagle3-K)")
    add_output(parser)
    args = parser.parse_args(argv)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process, where the warnings are caught
    from vllm import SamplingParams

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    model = str(ensure_demo_model())
    conversations = [p.messages for p in load_prompts(args.prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens or args.steps + 16, ignore_eos=True)
    rows = {}
    # adaptive_tree engines first: vLLM caches its attention backend per process (step_profile.lockstep).
    methods = sorted(args.methods.split(","), key=lambda m: step_profile.method_config(m) is None)
    for method in methods:
        job = {"model": model, "dtype": args.dtype, "max_model_len": 2048, "max_num_seqs": args.batch_size,
               "speculative_config": step_profile.with_draft_model(step_profile.method_config(method), args.head),
               "engine_layout": "in-process",
               "runner": engine_worker.V1_SYNC if method == "none-v1-sync" else None}
        llm = engine_worker.open_engine(job)
        tokenizer = llm.get_tokenizer()
        prompts = [tokenizer.apply_chat_template(c, add_generation_prompt=True, tokenize=False) for c in conversations]
        per_step, origins = count_syncs(llm, prompts, params, args.batch_size, args.steps)
        rows[method] = {"syncs_per_step": per_step, "origins": origins.most_common(8)}
        print(f"{method}: {per_step:.2f} synchronising calls per step; {origins.most_common(4)}", flush=True)
        del llm
        # After every method, so a run cut short keeps the counts of those done.
        write_report(args.out, f"sync_check_b{args.batch_size}", rows, table(rows))


def table(rows: dict) -> str:
    lines = ["| method | synchronising calls per step | where from (most often) |", "|---|---|---|"]
    lines += [f"| {method} | {row['syncs_per_step']:.2f} | {row['origins'][:2]} |" for method, row in rows.items()]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
