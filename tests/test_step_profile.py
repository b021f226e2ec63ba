"""The step profile's timers (``benchmarks/phase_times.py``):
engines stepped in turn in one process (``step_profile.py --engine-layout
lockstep``) keep their phases apart, code they share included. Pure logic,
no engine."""

import pytest

from benchmarks.phase_times import _Timer, _wrap


class _Attention:
    """Stands for code every engine of the process shares (an attention impl)."""

    def forward(self) -> int:
        return 1


_FORWARD = _Attention.forward


class _Runner:
    def __init__(self, attention: _Attention) -> None:
        self.attention = attention

    def execute_model(self) -> int:
        return self.attention.forward() + self.attention.forward()


def test_runners_stepped_in_turn_keep_their_own_phase_times():
    attention = _Attention()
    first, second = _Runner(attention), _Runner(attention)
    timers = _Timer(), _Timer()
    _wrap(_Attention, "forward", "attention", None)
    try:
        for runner, timer in zip((first, second), timers):
            _wrap(runner, "execute_model", "execute_model", timer)
        assert first.execute_model() == 2
        assert second.execute_model() == 2
        assert first.execute_model() == 2
        assert attention.forward() == 1  # outside any runner's step: timed on no runner
        assert dict(timers[0].calls) == {"execute_model": 2, "execute_model/attention": 4}
        assert dict(timers[1].calls) == {"execute_model": 1, "execute_model/attention": 2}
        assert timers[0].seconds["execute_model"] >= timers[0].seconds["execute_model/attention"] > 0
        assert _Timer.active is None
    finally:
        _Attention.forward = _FORWARD


def test_the_graph_each_forward_was_dispatched_to_is_counted():
    from vllm.config import CUDAGraphMode

    from benchmarks.phase_times import _count_graphs

    from benchmarks.step_profile import graphs

    modes = iter([CUDAGraphMode.FULL, CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL])

    class Dispatcher:
        def dispatch(self, num_tokens, **kwargs):
            return next(modes), num_tokens

    dispatcher, timer = Dispatcher(), _Timer()
    _count_graphs(dispatcher, timer)
    _count_graphs(dispatcher, timer)  # installed once
    assert [dispatcher.dispatch(n, uniform_decode=True) for n in (8, 9, 10)] == [
        (CUDAGraphMode.FULL, 8), (CUDAGraphMode.PIECEWISE, 9), (CUDAGraphMode.FULL, 10)]
    phases = {key: [timer.seconds[key], timer.calls[key]] for key in timer.seconds}
    assert phases == {"graph FULL": [0.0, 2], "graph PIECEWISE": [0.0, 1]}
    assert graphs(phases) == "FULL 2 / PIECEWISE 1"


def test_a_method_name_sets_a_policy_s_own_settings():
    """``NAME@POLICY:KEY=VALUE:...`` replaces the named settings (a shape the
    floor sweep does not run, such as a one-pass wide tree); without them the
    floor sweep's settings for that policy name apply."""
    from benchmarks.step_profile import method_config

    wide = method_config("eagle3-4@eagle2:top_k=4:depth=1")
    assert wide["tree"] == {"drafter": "eagle3", "policy": "eagle2", "top_k": 4, "depth": 1, "load_budget": "fixed"}
    assert method_config("eagle3-adaptive-8@eagle2-D18")["tree"] == {
        "drafter": "eagle3", "policy": "eagle2", "depth": 18, "load_budget": "adaptive"}
    with pytest.raises(ValueError):
        method_config("eagle3-4@eagle2:top_k=wide")
