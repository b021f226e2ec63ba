"""vLLM's API refusal of ``min_p`` and ``logit_bias`` under speculation is
lifted for ``adaptive_tree`` engines only, and their runners get vLLM's
built-in logits processors (the served requests: ``test_serve_parity.py``)."""

from __future__ import annotations

import pytest
from vllm.config.speculative import SpeculativeConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_adaptive_spec.adapter import config_hook, sampling_controls


def _ngram() -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize("params", [SamplingParams(min_p=0.1), SamplingParams(logit_bias={5: 1.0})],
                         ids=["min_p", "logit_bias"])
def test_min_p_and_logit_bias_are_accepted_under_adaptive_tree_only(params):
    config_hook.install()
    plain, tree = _ngram(), _ngram()
    sampling_controls.mark_tree_speculation(tree)
    with pytest.raises(VLLMValidationError, match="not yet supported with speculative decoding"):
        params._validate_spec_decode(plain)
    params._validate_spec_decode(tree)
    params._validate_spec_decode(None)


def test_the_mark_survives_pickling_to_vllm_processes():
    import pickle

    tree = _ngram()
    sampling_controls.mark_tree_speculation(tree)
    assert sampling_controls.is_tree_speculation(pickle.loads(pickle.dumps(tree)))
    assert not sampling_controls.is_tree_speculation(_ngram())
    assert not sampling_controls.is_tree_speculation(None)

