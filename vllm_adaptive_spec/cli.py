"""The ``vllm-adaptive-spec`` command."""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-adaptive-spec")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("demo-model", help="print the demo model's directory, converting it first if needed")
    commands.add_parser("demo", help="run the demo (options: vllm-adaptive-spec demo --help)", add_help=False)
    commands.add_parser(
        "vllm", help="run vLLM's own CLI, e.g. `vllm-adaptive-spec vllm serve MODEL ...`", add_help=False
    )
    commands.add_parser(
        "train-eagle3", help="train an EAGLE-3 head for the demo model (options: --help)", add_help=False
    )
    commands.add_parser(
        "eval-eagle3", help="score EAGLE-3 heads against the target on the benchmark prompts (options: --help)",
        add_help=False,
    )
    commands.add_parser(
        "draft-lm", help="build the demo model's draft LM (options: --help)", add_help=False
    )
    commands.add_parser(
        "c2t-collect", help="record the drafter's tree nodes for C2T's classifier (options: --help)", add_help=False
    )
    commands.add_parser("c2t-train", help="train C2T's classifier on collected rows (options: --help)", add_help=False)
    args, rest = parser.parse_known_args(argv)

    if args.command == "demo-model":
        if rest:
            parser.error(f"unrecognized arguments: {' '.join(rest)}")
        from vllm_adaptive_spec.demo_model import ensure_demo_model

        print(ensure_demo_model())
    elif args.command == "vllm":
        from vllm_adaptive_spec.adapter.cli_shim import run_vllm_cli

        run_vllm_cli(rest)
    elif args.command == "train-eagle3":
        from vllm_adaptive_spec.training.train_eagle3 import main as train_main

        train_main(rest)
    elif args.command == "eval-eagle3":
        from vllm_adaptive_spec.training.evaluate_head import main as eval_main

        eval_main(rest)
    elif args.command == "draft-lm":
        from vllm_adaptive_spec.training.draft_lm import main as draft_lm_main

        draft_lm_main(rest)
    elif args.command == "c2t-collect":
        from vllm_adaptive_spec.training.c2t import collect_main

        collect_main(rest)
    elif args.command == "c2t-train":
        from vllm_adaptive_spec.training.c2t import train_main

        train_main(rest)
    elif args.command == "demo":
        from vllm_adaptive_spec.demo import main as demo_main

        demo_main(rest)


if __name__ == "__main__":
    main(sys.argv[1:])
