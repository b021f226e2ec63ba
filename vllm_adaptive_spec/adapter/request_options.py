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
on it. :class:`Failures` runs such work: an exception costs the requests it
concerns their trees for that step (they are verified as if nothing were
drafted), is logged once per request with its id, and the step goes on.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

logger = logging.getLogger("vllm.adaptive_spec")

SPECULATION_KEY = "speculation"
SPECULATION_VALUES = ("on", "off")

T = TypeVar("T")


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


class Failures:
    """Runs per-request work so that an exception costs only trees: logged
    once per request id and place (``where``), counted, and answered with
    the caller's fallback."""

    MAX_LOGGED = 4096  # request ids remembered as logged (then forgotten: a later failure logs again)

    def __init__(self) -> None:
        self.count = 0
        self._logged: set[tuple[str, str]] = set()

    def run(self, where: str, request_ids: Iterable[str], work: Callable[[], T], fallback: Callable[[], T],
            then: str = "verified without a tree this step") -> T:
        """``work()``, or where it raises ``fallback()`` (``then`` says what
        that does, for the log)."""
        try:
            return work()
        except Exception:
            self.count += 1
            ids = [request_id for request_id in request_ids if (where, request_id) not in self._logged]
            if ids:
                if len(self._logged) > self.MAX_LOGGED:
                    self._logged.clear()
                self._logged.update((where, request_id) for request_id in ids)
                logger.exception("adaptive_tree: %s failed for request(s) %s; %s", where, ", ".join(ids), then)
            return fallback()
