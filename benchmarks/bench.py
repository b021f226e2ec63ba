"""``vllm-adaptive-spec bench <tool> [options]``: every benchmark tool behind
one command. Each tool is a module of this package with a ``main(argv)``;
``vllm-adaptive-spec bench <tool> --help`` prints its options and how to
reproduce its committed runs."""

from __future__ import annotations

import argparse
import importlib

# tool: (module, what it measures)
TOOLS = {
    "throughput": ("throughput", "offline tok/s of methods side by side, interleaved, per batch size"),
    "readme": ("readme_results", "the README's results table and plot, regenerated (about an hour)"),
    "step-profile": ("step_profile", "where an engine step's time goes, per method and batch size"),
    "floor-sweep": ("floor_sweep", "every drafter and policy under the load budget against its floor"),
    "before-after": ("before_after", "one change to the engine path: two checkouts in one interleaved run"),
    "serve-load": ("serve_load", "`vllm serve` under load and faults, with and without speculation"),
    "cold-start": ("cold_start", "what a fresh engine pays once: its first pass against the same pass warm"),
    "draft-host-time": ("draft_host_time", "a drafting step's host time outside torch operations, per batch"),
    "step-ops": ("step_ops", "the torch operations an engine step dispatches, by the code that dispatched them"),
    "retrieval-matchers": ("retrieval_matchers", "the retrieval drafter's trie and tensor matchers, timed"),
    "retrieval-calibration": ("retrieval_calibration", "whether retrieval node probabilities predict acceptance"),
    "policy-sweep": ("policy_sweep", "tree policies side by side on the demo pair"),
    "row-cost": ("row_cost", "what one more query row costs the target at batch 1"),
    "cpu-tree-attention": ("cpu_tree_attention", "the CPU tree attention path against vLLM's CPU kernel"),
    "sync-check": ("sync_check", "host waits for the GPU per engine step (GPU)"),
    "kernels": ("kernel_bench", "tree attention and KV compaction kernels against what they replace (GPU)"),
    "policy-kernels": ("policy_kernels", "the policy kernels against their torch references (GPU)"),
    "verifier-scratch": ("verifier_scratch", "peak memory and time of the verifier's tree-row targets"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="vllm-adaptive-spec bench", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    tools = parser.add_subparsers(dest="tool", required=True, metavar="TOOL")
    for name, (_, text) in TOOLS.items():
        tools.add_parser(name, help=text, add_help=False)
    args, rest = parser.parse_known_args(argv)
    importlib.import_module(f"benchmarks.{TOOLS[args.tool][0]}").main(rest)


if __name__ == "__main__":
    main()
