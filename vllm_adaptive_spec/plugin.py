"""The ``vllm.general_plugins`` entry point.

vLLM calls :func:`register` in every process (front end, engine core, workers)
before it builds any config. Registration must never break vLLM: on an
unsupported vLLM it logs one line naming the version it needs and registers
nothing, and an unexpected error is logged, not raised.
"""

from __future__ import annotations

import logging
import os

from vllm_adaptive_spec import __version__

# vLLM only routes loggers under "vllm." to its handler.
logger = logging.getLogger("vllm.adaptive_spec")

_registered = False


def register() -> bool:
    """Register the adaptive_tree method; return whether it is registered."""
    global _registered
    if _registered:
        return True
    try:
        from vllm_adaptive_spec import adapter

        problem = adapter.compatibility_problem()
        if problem:
            logger.warning(problem)
            return False
        from vllm_adaptive_spec.adapter import config_hook  # only once the installed vLLM is the one it hooks

        config_hook.install()
    except Exception:
        logger.exception("vllm-adaptive-spec failed to register; vLLM runs without it")
        return False
    _registered = True
    logger.info("vllm-adaptive-spec %s registered (pid %d)", __version__, os.getpid())
    return True
