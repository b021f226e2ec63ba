"""What one request may say about speculation, and what a failure costs it.

**Switching speculation off per request.** A client sends
``vllm_xargs: {"speculation": "off"}`` (OpenAI API) or
``SamplingParams(extra_args={"speculation": "off"})`` (offline): that request
gets no tree and no grammar-forced drafts, so every step verifies its one
row as vLLM without speculation samples it, while the rest of the batch keeps
drafting. Users of latency-critical or adversarial clients ask for this; the
option is read in the engine, where the request's sampling parameters
arrive with it. ``"on"`` (the default) leaves the request to the load
budget. Any other value is refused at the API (HTTP 400) naming the key and
the values, through vLLM's own sampling-parameter check.

**A failure costs a tree, never the engine.** The plugin's per-request work
(drafting, grammar forcing and cuts, tree-row processing) runs inside vLLM's
engine step, where an exception would stop the engine core and every request
on it. ``Failures`` runs such work: an exception costs the requests it
concerns their trees for that step (they are verified as if nothing were
drafted), is logged once per request with its id, and the step goes on
(:class:`~vllm_adaptive_spec.step.failures.Failures`).
"""

from __future__ import annotations

SPECULATION_KEY = "speculation"
SPECULATION_VALUES = ("on", "off")


def speculation_allowed(sampling_params) -> bool:
    """Whether the request leaves speculation on (the default)."""
    extra = getattr(sampling_params, "extra_args", None) or {}
    return extra.get(SPECULATION_KEY, "on") != "off"


def can_draft(sampling_params) -> bool:
    """Whether a request may get a tree: its sampling must be exactly what the
    tree verifier reproduces (penalties and bad words along each row's path,
    logit bias, ``min_p`` and ``min_tokens`` included: ``tree_history``,
    ``tree_logits_processors``; structured output masked per node by the
    scheduler, ``tree_scheduler``). Requests with a thinking budget are
    served without speculation instead, and so are those that switched it
    off (see above)."""
    return (sampling_params is not None and sampling_params.thinking_token_budget is None
            and speculation_allowed(sampling_params))


def check_speculation_option(sampling_params) -> None:
    """Refuse an unknown ``speculation`` value, as vLLM refuses a bad sampling parameter (HTTP 400)."""
    from vllm.exceptions import VLLMValidationError

    extra = sampling_params.extra_args or {}
    value = extra.get(SPECULATION_KEY, "on")
    if value not in SPECULATION_VALUES:
        raise VLLMValidationError(
            f"vllm_xargs[{SPECULATION_KEY!r}] (SamplingParams.extra_args) must be one of "
            f"{', '.join(repr(v) for v in SPECULATION_VALUES)}, got {value!r}",
            parameter=SPECULATION_KEY, value=value)
