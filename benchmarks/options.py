"""What the benchmark tools' command lines share: the output directory, the
workload (answer length, prompt set, batch sizes and prompts per pass) and
the one ``--spec`` parser, so every tool spells and checks them alike."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# A checkout keeps the tools' output beside them; an installed copy writes under the working directory.
OUT = (REPO if (REPO / ".git").exists() else Path.cwd()) / "benchmarks" / "out"
HELDOUT = REPO / "benchmarks" / "data" / "heldout_prompts.jsonl"


def add_output(parser: argparse.ArgumentParser, subdir: str = "") -> None:
    """``--out``: where the tool writes its report (JSON, Markdown, plot) and
    its engines' logs; under ``benchmarks/out/``, which git ignores (the
    committed results pages are ``benchmarks/results/``)."""
    parser.add_argument("--out", type=Path, default=OUT / subdir,
                        help="directory for the report (JSON, Markdown, plot) and logs (default: %(default)s)")


def add_workload(parser: argparse.ArgumentParser, max_tokens: int | None, prompts: Path | None = HELDOUT) -> None:
    """``--max-tokens`` and ``--prompts``: the answer length a request may
    reach (None: a preset the tool fills in) and the prompt set (JSONL; the
    held-out set unless a tool says otherwise; None: the project's own
    prompts)."""
    parser.add_argument("--max-tokens", type=positive_int, default=max_tokens,
                        help=f"most tokens an answer may have (default: {max_tokens or 'the preset'})")
    parser.add_argument("--prompts", type=Path, default=prompts,
                        help="prompt set JSONL (default: " + (str(prompts) if prompts else "the project's prompts") + ")")


def add_sampling(parser: argparse.ArgumentParser) -> None:
    """``--sampling JSON``: sampling parameters every request adds to greedy
    decoding (e.g. ``{"repetition_penalty": 1.1}`` or ``{"structured_outputs":
    {"json": SCHEMA}}``, ``StructuredOutputsParams``' keyword arguments)."""
    parser.add_argument("--sampling", type=json.loads, default={},
                        help="JSON of sampling parameters added to every request (default: none)")


def add_batches(parser: argparse.ArgumentParser, batch_sizes: str | None, prompts_per_batch: str | None = None) -> None:
    """``--batch-sizes`` and, where a tool takes it, ``--prompts-per-batch``
    (one count per batch size; :func:`check_batches` checks the two agree)."""
    parser.add_argument("--batch-sizes", type=int_list, default=None if batch_sizes is None else int_list(batch_sizes),
                        help=f"comma list (default: {batch_sizes or 'the preset'})")
    if prompts_per_batch is not None:
        parser.add_argument("--prompts-per-batch", type=int_list, default=int_list(prompts_per_batch),
                            help=f"prompts of a pass at each batch size, one per batch size (default: {prompts_per_batch})")


def check_batches(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """A usage error when the prompt counts do not match the batch sizes."""
    if len(args.prompts_per_batch) != len(args.batch_sizes):
        parser.error(f"--prompts-per-batch needs one count per batch size ({len(args.batch_sizes)}), "
                     f"got {len(args.prompts_per_batch)}")


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"a positive integer, got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """``1,8,64`` as ``[1, 8, 64]``: positive integers, comma-separated."""
    try:
        values = [positive_int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a comma list of positive integers, got {text!r}") from None
    if not values:
        raise argparse.ArgumentTypeError("a comma list of positive integers, got nothing")
    return values


def parse_spec(text: str) -> tuple[str, dict | None]:
    """A ``--spec`` value: ``LABEL=JSON``, or ``JSON`` alone (label
    ``speculation``); the JSON is a speculative config, or ``null`` for no
    speculation (a control engine or server)."""
    label, sep, rest = text.partition("=")
    if sep and label.strip() and not label.lstrip().startswith("{"):
        label, config = label.strip(), rest
    elif text.lstrip().startswith("{") or text.strip() == "null":
        label, config = "speculation", text
    else:
        raise argparse.ArgumentTypeError(f"--spec takes [LABEL=]JSON, got {text!r}")
    try:
        spec = json.loads(config)
    except json.JSONDecodeError as error:
        raise argparse.ArgumentTypeError(f"--spec {label}: not JSON ({error})") from None
    if spec is not None and not isinstance(spec, dict):
        raise argparse.ArgumentTypeError(f"--spec {label}: a JSON object or null, got {config!r}")
    return label, spec
