"""What the benchmark tools' command lines share."""

from __future__ import annotations

import argparse
import json


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
