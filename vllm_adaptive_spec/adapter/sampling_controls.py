"""``min_p`` and ``logit_bias`` requests under ``adaptive_tree``.

vLLM 0.32 refuses both at its API whenever any speculative config is set
(``SamplingParams._validate_spec_decode``: HTTP 400 "The min_p and
logit_bias sampling parameters are not yet supported with speculative
decoding"), and under speculation its runner builds only the ``min_tokens``
logits processor, because its chain rejection sampler applies no other
processor to draft rows. A server without speculation serves both, so
turning speculation on would make some clients fail.

The plugin serves such requests with trees: vLLM's own ``Sampler`` applies
every logits processor in the input batch to rows without a tree, in vLLM's
order (``min_tokens`` and ``logit_bias`` before the penalties, ``min_p``
after the temperature), and the tree verifier repeats ``logit_bias`` and
``min_p`` on every tree row from those processors' state
(``tree_logits_processors``). So for ``adaptive_tree`` engines only, the API
check is lifted and the runner's input batch gets all of vLLM's built-in
processors, exactly those vLLM builds without speculation; these requests
are then sampled as vLLM samples them without speculation. Engines with vLLM's own methods keep vLLM's
behaviour: the lift looks for the mark :func:`mark_tree_speculation` puts on
the plugin's speculative config (it survives pickling to vLLM's processes).
Custom logits processors (``--logits-processors``) stay refused, as vLLM
refuses them under speculation: they would have to apply to tree rows too.
"""

from __future__ import annotations

import functools
import logging

from vllm_adaptive_spec.adapter.request_options import check_speculation_option

logger = logging.getLogger("vllm.adaptive_spec")

_MARK = "_adaptive_tree"


def mark_tree_speculation(speculative_config) -> None:
    """Mark ``speculative_config`` (vLLM's ``SpeculativeConfig``) as the
    plugin's (the native method it carries is a stock one)."""
    setattr(speculative_config, _MARK, True)


def is_tree_speculation(speculative_config) -> bool:
    return bool(getattr(speculative_config, _MARK, False))


def install() -> None:
    """Lift vLLM's API refusal of ``min_p`` and ``logit_bias`` for the
    plugin's speculative configs, and check their per-request
    ``speculation`` option there (``request_options``; idempotent)."""
    from vllm.sampling_params import SamplingParams

    original = SamplingParams._validate_spec_decode
    if getattr(original, "_adaptive_tree_wrapper", False):
        return

    @functools.wraps(original)
    def _validate_spec_decode(self, speculative_config) -> None:
        if is_tree_speculation(speculative_config):
            check_speculation_option(self)
            return
        original(self, speculative_config)

    _validate_spec_decode._adaptive_tree_wrapper = True
    SamplingParams._validate_spec_decode = _validate_spec_decode


def builtin_logits_processors(vllm_config, device, pin_memory: bool):
    """vLLM's built-in logits processors (``min_tokens``, ``logit_bias``,
    ``min_p``), as vLLM builds them for an engine without speculation."""
    from vllm.v1.sample.logits_processor import BUILTIN_LOGITS_PROCESSORS, LogitsProcessors

    logger.info("adaptive_tree applies min_p and logit_bias (to tree rows too); vLLM's warning that they "
                "won't work with speculative decoding does not apply to this engine")
    return LogitsProcessors(ctor(vllm_config, device, pin_memory) for ctor in BUILTIN_LOGITS_PROCESSORS)
