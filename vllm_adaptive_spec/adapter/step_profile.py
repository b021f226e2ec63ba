"""Wall time of an engine step's phases, measured inside the worker.

For ``benchmarks/step_profile.py``: ``llm.collective_rpc(install)`` wraps the
worker's model runner (any method: no speculation, vLLM's own drafters and
``adaptive_tree``) with timers; ``collective_rpc(report)`` returns, per phase
path (``"sample_tokens/draft/grow"``), the inclusive seconds and the calls
since the last ``reset``. Nested phases are keyed by their whole path, so the
attention of the target forward and of a draft pass are told apart.

Phases: ``execute_model`` (``prepare``: vLLM's input layout plus the tree
layout; ``forward``: the target model, within it ``attention`` for vLLM's
stock kernel and ``tree_attention`` for tree rows), ``sample_tokens``
(``verify``: vLLM's sampler or the tree verifier, within it ``compaction``:
moving accepted KV and the budget's observations; ``draft``: the drafter,
within it ``draft_first_pass`` / ``draft_pass`` for model drafters and
``grow`` for the tree proposer). Installing costs nothing when not used.

On CUDA the timers read the host's clock while kernels run asynchronously:
a phase's time is its Python and launch cost, plus the GPU's time only where
the host waits for the device (a ``.tolist()``, an ``.item()``). That is the
host time per step the plugin adds beside vLLM's own.
"""

from __future__ import annotations

import time
from collections import defaultdict


class _Timer:
    def __init__(self) -> None:
        self.stack: list[str] = []
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, name: str, fn):
        def timed(*args, **kwargs):
            self.stack.append(name)
            key = "/".join(self.stack)
            started = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds[key] += time.perf_counter() - started
                self.calls[key] += 1
                self.stack.pop()

        timed._step_profile_wrapped = True
        return timed


_timer: _Timer | None = None


def _wrap_method(owner, attribute: str, name: str) -> None:
    fn = getattr(owner, attribute, None)
    if fn is None or getattr(fn, "_step_profile_wrapped", False):
        return
    setattr(owner, attribute, _timer.wrap(name, fn))


def install(worker) -> bool:
    """Wrap ``worker``'s model runner and the attention code of this process."""
    global _timer
    if _timer is None:
        _timer = _Timer()
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        from vllm.v1.attention.backends.flash_attn import FlashAttentionImpl
        from vllm.v1.attention.backends.triton_attn import TritonAttentionImpl

        from vllm_adaptive_spec.adapter import attention_cuda as tree_module

        stock_impls, tree_function = (FlashAttentionImpl, TritonAttentionImpl), "tree_attention"
    else:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl

        from vllm_adaptive_spec.adapter import attention_cpu as tree_module

        stock_impls, tree_function = (CPUAttentionBackendImpl,), "paged_tree_attention"

    runner = worker.model_runner
    for attribute, name in (
        ("execute_model", "execute_model"),
        ("_prepare_inputs", "prepare"),
        ("_model_forward", "forward"),
        ("sample_tokens", "sample_tokens"),
        ("_sample", "verify"),
        ("_after_acceptance", "compaction"),
        ("propose_draft_token_ids", "draft"),
    ):
        _wrap_method(runner, attribute, name)
    for impl in stock_impls:
        _wrap_method(impl, "forward", "attention")
    proposer = getattr(runner, "_tree_proposer", None)
    if proposer is not None:
        _wrap_method(proposer, "propose_trees", "grow")
        _wrap_method(tree_module, tree_function, "tree_attention")
    backend = getattr(runner, "_draft_backend", None)
    if backend is not None:
        _wrap_method(backend, "first_pass", "draft_first_pass")
        _wrap_method(backend, "feed", "draft_pass")
        _wrap_method(backend, "_feed_rows", "draft_forward")
    if proposer is not None and getattr(runner, "rejection_sampler", None) is not None:
        verifier = runner.rejection_sampler
        verifier.on_accept = runner._after_acceptance
    return True


def reset(worker) -> bool:
    if _timer is not None:
        _timer.seconds.clear()
        _timer.calls.clear()
    return True


def report(worker) -> dict:
    """``{phase path: [seconds, calls]}`` since the last reset."""
    if _timer is None:
        return {}
    return {key: [_timer.seconds[key], _timer.calls[key]] for key in _timer.seconds}
