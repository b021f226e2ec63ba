"""When a drafter drafts at all: the load budget's pauses, probes, windows
and control steps as one small state machine (docs/algorithms.md section 8;
what each rule was measured against: docs/load_budget.md).

Each step starts with :meth:`PauseControl.begin_step`, which judges the last
measured step and returns the step's :class:`StepDecision`; the budget's
choice then reports the step's expected rates with :meth:`judge`, and the
verified trees' accepted nodes arrive through :meth:`accepted`.

* **Windows.** Measured steps are judged in windows of ``pause_after``: a
  window whose relative gains sum below zero pauses drafting. A window
  pauses before its end once its expected losses add up to one clear loss
  (``1 - clear_loss`` of a step), and at once on a step expected below
  ``clear_loss`` times the rate without drafting. With ``realized`` (model
  drafters) a window is judged on the tokens its steps committed in their
  modelled time (the fitted step, a tree's own cost included, and the
  measured drafting); a retrieval drafter's stays on the expectation.
  Decision: no margin on what drafting adds. One of 25% took about 6
  points off an EAGLE-3 head's realized gain at batch 1 and lost a window
  in six by noise, each loss doubling the next pause (docs/load_budget.md).
* **Pauses and probes.** A pause lasts ``pause_steps`` steps, doubling per
  pause that follows a losing probe (up to ``max_pause``), and at least as
  long as one more drafting step like the last costs ``probe_share`` of the
  paused steps' time (up to ``max_probe_pause``). The step after it is a
  probe; a probe expected to lose pauses again at once.
* **Slow start.** Until drafting has paid over a whole window (from the
  start and after every pause) a model drafter drafts for at most
  ``probe_requests`` requests a step (``StepDecision.limit``).
* **Control steps.** While the step-cost fit cannot tell a tree's own cost
  from the fixed cost (:meth:`StepCostFit.tree_spread` below
  ``CONTROL_SPREAD``), one step in ``CONTROL_GAP`` drafts nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from vllm_adaptive_spec.budget.cost_fit import StepCostFit

CONTROL_SPREAD, CONTROL_GAP = 0.02, 16


class StepDecision(NamedTuple):
    """What a step does: whether it ``drafts`` at all, whether it is a
    ``control`` step (drafts nothing, for the step-cost fit) or a
    ``probing`` one (the first drafting step after a pause), and how many
    requests a model drafter may draft for (``limit``; None: all)."""

    drafts: bool
    control: bool = False
    probing: bool = False
    limit: int | None = None


@dataclass(frozen=True)
class PauseSettings:
    pause_after: int = 16
    clear_loss: float = 0.5
    pause_steps: int = 16
    max_pause: int = 512
    probe_requests: int = 4
    probe_share: float = 0.01
    max_probe_pause: int = 8192


class PendingStep(NamedTuple):
    """The last measured step, until its trees are verified: ``tokens``
    committed so far, its modelled ``seconds``, and the rate ``without`` drafting."""

    tokens: float
    seconds: float
    without: float


class PauseControl:
    def __init__(self, settings: PauseSettings, realized: bool) -> None:
        self.settings, self.realized = settings, realized
        self._paused = 0
        self._next_pause = settings.pause_steps
        self._probing = False
        self._proven = False
        self._since_control = 0
        self._pending: PendingStep | None = None
        self._window_steps, self._window_gain, self._window_realized = 0, 0.0, 0.0
        self._last_drafting = 0.0  # seconds the last drafting step took
        self._plain_step = 0.0  # the modelled seconds of a plain step like the last measured one

    def begin_step(self, fit: StepCostFit) -> StepDecision:
        """The step's decision, the step before it (verified by now) judged first."""
        self.settle()
        if self._paused > 0:
            self._paused -= 1
            self._probing = self._paused == 0
            return StepDecision(drafts=False)
        self._since_control += 1
        if (fit.steps_seen >= StepCostFit.MIN_STEPS and fit.tree_spread() < CONTROL_SPREAD
                and self._since_control >= CONTROL_GAP):
            self._since_control = 0
            return StepDecision(drafts=False, control=True)
        return StepDecision(True, probing=self._probing,
                            limit=None if self._proven else self.settings.probe_requests)

    def drafted(self, seconds: float) -> None:
        """The step's drafting took ``seconds``."""
        self._last_drafting = seconds

    def accepted(self, nodes: int) -> None:
        """Nodes of the last measured step's trees were accepted."""
        if self._pending is not None:
            self._pending = self._pending._replace(tokens=self._pending.tokens + nodes)

    def judge(self, with_drafting: float | None, without: float, tokens: int = 0, seconds: float = 0.0,
              plain_seconds: float = 0.0) -> None:
        """A step's expected rate ``with_drafting`` (None: not measurable
        yet) against the rate ``without`` drafting: pause on a probe that
        expects to lose, on a clear loss, or on a window's losses adding up
        to one; with ``realized``, the step waits for its verified tokens
        (``tokens`` committed without a node accepted, in the modelled
        ``seconds``, ``plain_seconds`` of them a step without drafting)."""
        probing, self._probing = self._probing, False
        self._pending = None
        if with_drafting is None:
            return
        self._plain_step = plain_seconds
        gain = with_drafting / without - 1.0 if without > 0.0 else 0.0
        self._window_steps += 1
        self._window_gain += gain
        clear_loss = self.settings.clear_loss
        if (probing and gain < 0.0) or with_drafting < clear_loss * without or self._window_gain < clear_loss - 1.0:
            self._pause()
        elif self.realized:
            self._pending = PendingStep(float(tokens), seconds, without)
        else:
            self._close_window(self._window_gain)

    def settle(self) -> None:
        """Judge the last measured step by its realized relative gain."""
        if self._pending is None:
            return
        tokens, seconds, without = self._pending
        self._pending = None
        realized = tokens / seconds if seconds > 0.0 else 0.0
        self._window_realized += realized / without - 1.0 if without > 0.0 else 0.0
        self._close_window(self._window_realized)

    def _close_window(self, gains: float) -> None:
        if self._window_steps < self.settings.pause_after:
            return
        if gains < 0.0:
            self._pause()
        else:
            self._reset_window()
            self._next_pause = self.settings.pause_steps
            self._proven = True

    def _reset_window(self) -> None:
        self._window_steps, self._window_gain, self._window_realized = 0, 0.0, 0.0

    def _pause(self) -> None:
        """The next pause of the doubling schedule, or longer where one more
        drafting step like the last would cost more than ``probe_share`` of
        the paused steps."""
        settings = self.settings
        self._paused = self._next_pause
        if self._plain_step > 0.0 and self._last_drafting > 0.0:
            costly = math.ceil(self._last_drafting / (settings.probe_share * self._plain_step))
            self._paused = max(self._paused, min(costly, settings.max_probe_pause))
        self._proven = False
        self._next_pause = min(2 * self._next_pause, settings.max_pause)
        self._pending = None
        self._reset_window()
