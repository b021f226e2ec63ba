"""A request's ``speculation`` option (checked where vLLM checks sampling
parameters, so its API answers 400 for a bad value) and what a failure in
the plugin's per-request work costs (``adapter/request_options``, ``step/failures``; on the
engine: ``test_engine_request_isolation.py``)."""

from __future__ import annotations

import logging

import pytest
from vllm.config.speculative import SpeculativeConfig
from vllm.exceptions import VLLMValidationError
from vllm.sampling_params import SamplingParams

from vllm_adaptive_spec.adapter import config_hook, request_options, sampling_controls
from vllm_adaptive_spec.step.failures import Failures


def _ngram() -> SpeculativeConfig:
    return SpeculativeConfig(method="ngram", num_speculative_tokens=3, prompt_lookup_max=3, prompt_lookup_min=1)


@pytest.mark.parametrize("value", ["on", "off"])
def test_a_request_may_switch_speculation_on_or_off(value):
    config_hook.install()
    tree = _ngram()
    sampling_controls.mark_tree_speculation(tree)
    params = SamplingParams(extra_args={"speculation": value})
    params._validate_spec_decode(tree)
    assert request_options.speculation_allowed(params) == (value == "on")
    assert request_options.speculation_allowed(SamplingParams())


@pytest.mark.parametrize("value", ["of", "OFF", 0, None])
def test_an_unknown_speculation_value_is_refused_naming_the_key_and_the_values(value):
    """Refused as vLLM refuses a bad sampling parameter (its API answers 400);
    servers without the plugin's speculation ignore the key, as vLLM does."""
    config_hook.install()
    tree = _ngram()
    sampling_controls.mark_tree_speculation(tree)
    params = SamplingParams(extra_args={"speculation": value})
    with pytest.raises(VLLMValidationError, match=r"vllm_xargs\['speculation'\].*'on', 'off', got"):
        params._validate_spec_decode(tree)
    params._validate_spec_decode(None)



def test_a_failure_costs_the_fallback_and_is_logged_once_per_request(caplog):
    failures = Failures()

    def broken():
        raise RuntimeError("injected")

    with caplog.at_level(logging.ERROR, logger="vllm.adaptive_spec"):
        assert failures.run("drafting", ["a", "b"], broken, lambda: "fallback") == "fallback"
        assert failures.run("drafting", ["a"], broken, list) == []
        assert failures.run("drafting", ["a", "c"], lambda: "work", list) == "work"
        assert failures.run("grammar forcing", ["a"], broken, list) == []
    logged = [record.getMessage() for record in caplog.records]
    assert failures.count == 3 and len(logged) == 2, logged
    assert "drafting failed for request(s) a, b" in logged[0] and "grammar forcing" in logged[1]
