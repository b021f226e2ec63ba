"""A failure costs a tree, never the engine: the plugin's per-request work
(drafting, grammar forcing and cuts, tree-row processing) runs inside
vLLM's engine step, where an exception would stop the engine core and every
request on it. :class:`Failures` runs such work so that an exception costs
the requests it concerns their trees for that step (they are verified as if
nothing were drafted), is logged once per request with its id, and the step
goes on."""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import TypeVar

logger = logging.getLogger("vllm.adaptive_spec")

T = TypeVar("T")


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
