"""The retrieval drafter's matchers timed side by side: the trie (an
incremental suffix index and lazy tries) in Python and in native code
(``drafters/retrieval_native.py``, where the native CPU library builds), and
the tensors (``drafters/retrieval_tensors.py``), the same trees (checked here
on every step too). Per step and batch size: ``prepare`` with each request's context
one token longer, then the candidate trees at the retrieval policy's floor
(0.05), as the proposer asks for them.

Workload: the held-out prompts (chat template of the demo model's
tokenizer), each request's "answer" the prompt's own tokens again from a
random point (retrieval's best case, where its trees are largest), steps
interleaved between the matchers.

Reproduce (one thread, as an engine's drafter runs)::

    .venv/bin/vllm-adaptive-spec bench retrieval-matchers --batch-sizes 1,8,64 --steps 32
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import torch

from benchmarks.options import HELDOUT, add_batches, add_output
from benchmarks.report import write_report
from vllm_adaptive_spec.demo_model import ensure_demo_model
from kernels.cpu_library import native_library
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_native import NativeRetrievalDrafter
from vllm_adaptive_spec.drafters.retrieval_tensors import TensorRetrievalDrafter
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter

def streams(batch: int, length: int, seed: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ensure_demo_model())
    rows = [json.loads(line) for line in HELDOUT.read_text(encoding="utf-8").splitlines()]
    rng = random.Random(seed)
    out = []
    for b in range(batch):
        text = tokenizer.apply_chat_template(rows[b % len(rows)]["messages"], tokenize=False)
        prompt = tokenizer.encode(text, add_special_tokens=False)
        start = rng.randrange(len(prompt) // 2)
        out.append((prompt + prompt[start:] * 4)[: len(prompt) + length])
    return out


def time_matchers(batch: int, steps: int, seed: int = 0) -> dict:
    full = streams(batch, steps + 1, seed)
    ids = [f"r{b}" for b in range(batch)]
    drafters = {"trie": RetrievalDrafter(), "tensors": TensorRetrievalDrafter("cpu")}
    if native_library() is not None:
        drafters["native"] = NativeRetrievalDrafter()
    seconds = {name: [] for name in drafters}
    for step in range(steps, -1, -1):
        contexts = Contexts.of([stream[: len(stream) - step] for stream in full])  # the proposer's gather
        trees = {}
        for name, drafter in drafters.items():
            started = time.perf_counter()
            drafter.prepare(ids, contexts)
            trees[name] = drafter.candidate_trees(0.05)
            if step < steps:  # the first step builds the trie's index from the whole prompt
                seconds[name].append(time.perf_counter() - started)
        if any(trees[name] != trees["trie"] for name in drafters):
            raise AssertionError(f"the matchers' trees differ at batch {batch}, step {steps - step}")
    nodes = sum(len(t) for t in trees["trie"]) / batch
    return {"batch": batch, "nodes_per_tree": nodes,
            **{f"{name}_ms": 1e3 * statistics.median(values) for name, values in seconds.items()}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_batches(parser, "1,8,64")
    parser.add_argument("--steps", type=int, default=32)
    add_output(parser)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rows = [time_matchers(b, args.steps) for b in args.batch_sizes]
    names = [key[:-3] for key in rows[0] if key.endswith("_ms")]
    lines = ["| batch | nodes/tree | " + " | ".join(f"{name} ms/step" for name in names) + " |",
             "|---|---|" + "---|" * len(names)]
    lines += [f"| {row['batch']} | {row['nodes_per_tree']:.1f} | " + " | ".join(f"{row[name + '_ms']:.3f}" for name in names)
              + " |" for row in rows]
    write_report(args.out, "retrieval_matchers", {"steps": args.steps, "rows": rows}, "\n".join(lines))


if __name__ == "__main__":
    main()
