"""Wall time of an engine step's phases, measured inside the worker.

For ``benchmarks/step_profile.py``: ``llm.collective_rpc(install)`` wraps the
worker's model runner (any method: no speculation, vLLM's own drafters and
``adaptive_tree``) with timers; ``collective_rpc(report)`` returns, per phase
path (``"sample_tokens/draft/grow"``), the inclusive seconds and the calls
since the last ``reset``. Nested phases are keyed by their whole path, so the
attention of the target forward and of a draft pass are told apart.

Phases: ``execute_model`` (``prepare``: vLLM's input layout plus the tree
layout; ``forward``: the target model, within it ``attention`` for vLLM's
stock kernel and ``tree_attention`` for the tree path: tree rows, or a whole pass on
the CPU's native op), ``sample_tokens``
(``verify``: vLLM's sampler or the tree verifier, within it ``compaction``:
moving accepted KV and the budget's observations; ``draft``: the drafter,
within it ``draft_first_pass`` / ``draft_pass`` for model drafters and
``grow`` for the tree proposer). Installing costs nothing when not used.
Beside the phases, ``graph FULL`` / ``graph PIECEWISE`` / ``graph NONE``
count the CUDA graph runtime modes the runner's dispatcher chose (0 s each):
on CUDA a step's cost depends mostly on which graph, if any, it replays; on
the CPU every step is ``NONE``.

On CUDA the timers read the host's clock while kernels run asynchronously:
a phase's time is its Python and launch cost, plus the GPU's time only where
the host waits for the device (a ``.tolist()``, an ``.item()``). That is the
host time per step the plugin adds beside vLLM's own.
"""

from __future__ import annotations

import time
from collections import defaultdict


class _Timer:
    """One model runner's phase times. Code every engine of the process
    shares (attention impls, the tree attention function) is timed on the
    timer of the runner whose step is running (``active``), so engines
    stepped in turn in one process (``step_profile.py --engine-layout
    lockstep``) keep their phases apart."""

    active: _Timer | None = None

    def __init__(self) -> None:
        self.stack: list[str] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def run(self, name: str, fn, args, kwargs):
        outer, _Timer.active = _Timer.active, self
        self.stack.append(name)
        key = "/".join(self.stack)
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            self.seconds[key] += time.perf_counter() - started
            self.calls[key] += 1
            self.stack.pop()
            _Timer.active = outer


def _wrap(owner, attribute: str, name: str, timer: _Timer | None) -> None:
    """Time ``owner.attribute`` on ``timer``, or (None: code shared by every
    runner) on the active runner's timer."""
    fn = getattr(owner, attribute, None)
    if fn is None or getattr(fn, "_step_profile_wrapped", False):
        return

    def timed(*args, **kwargs):
        current = timer or _Timer.active
        return fn(*args, **kwargs) if current is None else current.run(name, fn, args, kwargs)

    timed._step_profile_wrapped = True
    setattr(owner, attribute, timed)


GRAPH_KEY = "graph "  # the target's forwards
DRAFT_GRAPH_KEY = "draft graph "  # a model drafter's


def _count_graphs(dispatcher, timer: _Timer, prefix: str = GRAPH_KEY) -> None:
    """Count ``dispatcher``'s runtime modes on ``timer`` as ``PREFIX MODE``."""
    fn = dispatcher.dispatch
    if getattr(fn, "_step_profile_wrapped", False):
        return

    def counted(*args, **kwargs):
        mode, descriptor = fn(*args, **kwargs)
        key = prefix + mode.name
        timer.seconds[key] += 0.0
        timer.calls[key] += 1
        return mode, descriptor

    counted._step_profile_wrapped = True
    dispatcher.dispatch = counted


def install(worker) -> bool:
    """Wrap ``worker``'s model runner (with a timer of its own) and the attention code of this process."""
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        from vllm_adaptive_spec.adapter import attention_cuda as tree_module

        stock_impls, tree_functions = (FlashAttentionImpl, TritonAttentionImpl), ("tree_attention",)
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        from vllm_adaptive_spec.adapter import attention_cpu as tree_module

        stock_impls = (CPUAttentionBackendImpl,)
        tree_functions = ("tree_attention_cpu", "paged_tree_attention", "draft_pass_attention")

    runner = worker.model_runner
    if getattr(runner, "_step_timer", None) is not None:
        return True
    timer = runner._step_timer = _Timer()
    for attribute, name in (
        ("execute_model", "execute_model"),
        ("_prepare_inputs", "prepare"),
        ("_model_forward", "forward"),
        ("sample_tokens", "sample_tokens"),
        ("_sample", "verify"),
        ("_after_acceptance", "compaction"),
        ("propose_draft_token_ids", "draft"),
    ):
        _wrap(runner, attribute, name, timer)
    if getattr(runner, "cudagraph_dispatcher", None) is not None:
        _count_graphs(runner.cudagraph_dispatcher, timer)
    for impl in stock_impls:
        _wrap(impl, "forward", "attention", None)
    proposer = getattr(runner, "_tree_proposer", None)
    if proposer is not None:
        _wrap(proposer, "propose_trees", "grow", timer)
        for function in tree_functions:
            _wrap(tree_module, function, "tree_attention", None)
    backend = getattr(runner, "_draft_backend", None)
    if backend is not None:
        _wrap(backend, "first_pass", "draft_first_pass", timer)
        _wrap(backend, "feed", "draft_pass", timer)
        _wrap(backend, "_feed_rows", "draft_forward", timer)
        _count_graphs(backend.native.cudagraph_dispatcher, timer, DRAFT_GRAPH_KEY)
    if proposer is not None and getattr(runner, "rejection_sampler", None) is not None:
        verifier = runner.rejection_sampler
        verifier.on_accept = runner._after_acceptance
    return True


def reset(worker) -> bool:
    timer = getattr(worker.model_runner, "_step_timer", None)
    if timer is not None:
        timer.seconds.clear()
        timer.calls.clear()
    return True


def report(worker) -> dict:
    """``{phase path: [seconds, calls]}`` since the last reset."""
    timer = getattr(worker.model_runner, "_step_timer", None)
    if timer is None:
        return {}
    return {key: [timer.seconds[key], timer.calls[key]] for key in timer.seconds}
