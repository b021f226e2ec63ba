"""The ``vllm-adaptive-spec`` command."""

from __future__ import annotations

import argparse
import importlib
import sys

# command: (module, function taking the remaining arguments, help)
COMMANDS = {
    "demo": ("vllm_adaptive_spec.demo", "main", "run the demo (options: vllm-adaptive-spec demo --help)"),
    "vllm": ("vllm_adaptive_spec.adapter.cli_shim", "run_vllm_cli",
             "run vLLM's own CLI, e.g. `vllm-adaptive-spec vllm serve MODEL ...`"),
    "train-eagle3": ("vllm_adaptive_spec.training.train_eagle3", "main",
                     "train an EAGLE-3 head for the demo model (options: --help)"),
    "eval-eagle3": ("vllm_adaptive_spec.training.evaluate_head", "main",
                    "score EAGLE-3 heads against the target on the benchmark prompts (options: --help)"),
    "draft-lm": ("vllm_adaptive_spec.training.train_draft_lm", "main", "build the demo model's draft LM (options: --help)"),
    "c2t-collect": ("vllm_adaptive_spec.training.train_c2t", "collect_main",
                    "record the drafter's tree nodes for C2T's classifier (options: --help)"),
    "c2t-train": ("vllm_adaptive_spec.training.train_c2t", "train_main",
                  "train C2T's classifier on collected rows (options: --help)"),
    "bench": ("benchmarks.bench", "main", "run a benchmark tool (vllm-adaptive-spec bench --help lists them)"),
}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-adaptive-spec")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo-model", help="print the demo model's directory, converting it first if needed")
    for name, (_, _, text) in COMMANDS.items():
        commands.add_parser(name, help=text, add_help=False)
    args, rest = parser.parse_known_args(argv)

    if args.command == "demo-model":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        print(ensure_demo_model())
        return
    module, function, _ = COMMANDS[args.command]
    getattr(importlib.import_module(module), function)(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
