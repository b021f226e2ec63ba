"""A guard over the device part of every tree step of a real engine (issue 52).

Installed in the engine's worker with ``collective_rpc(install)`` (the engine
job's ``step_guard``), it wraps the tree verifier's ``forward`` (target
tokens, acceptance, vLLM's output, KV compaction, the statistics' copy) and
the runner's depth positions. Inside, a dispatch mode records every torch
operation whose caller (the innermost frame outside torch) is the plugin's
code, and every read of a tensor's value by that code: what ``item``,
``bool``, ``int`` and ``nonzero`` dispatch, and ``Tensor.tolist`` (which
dispatches nothing); the CPU's own KV compaction (``HOST_ONLY``), which
never runs on a GPU, is left out. On a GPU each such read would make the host wait for
the device in the middle of the step. ``report`` returns the reads and, per
tree step, the operations dispatched.
"""

from __future__ import annotations

import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PLUGIN = ("/vllm_adaptive_spec/", "/kernels/")
# Code that runs only where there is no device, so reading a value there waits for nothing:
# the CPU's KV compaction finds its moving pairs on the host, where they already are.
HOST_ONLY = {"compact_kv_cpu"}
READS = ("_local_scalar_dense", "nonzero", "is_nonzero")


def plugin_caller() -> str | None:
    """``file:line`` of the innermost caller outside torch and this file, if it is the plugin's."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("step_guard.py"):
            if frame.f_code.co_name in HOST_ONLY:
                return None
            return f"{name}:{frame.f_lineno}" if any(part in name for part in PLUGIN) else None
        frame = frame.f_back
    return None


class StepGuard(TorchDispatchMode):
    def __init__(self, record) -> None:
        super().__init__()
        self.record = record
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        caller = plugin_caller()
        if caller is not None:
            self.ops[f"{func} at {caller.rsplit('/', 1)[-1]}"] += 1
            if any(read in str(func) for read in READS):
                self.record["reads"].append(f"{func} at {caller}")
        return func(*args, **(kwargs or {}))


def _guarded(function, record, per_step: bool):
    def run(*args, **kwargs):
        from vllm_adaptive_spec.adapter import step as tree_step

        current = tree_step.current()
        tree = isinstance(current, tree_step.TreeStep) and bool(current.trees)
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            caller = plugin_caller()
            if caller is not None:
                record["reads"].append(f"tolist at {caller}")
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        try:
            with StepGuard(record) as guard:
                result = function(*args, **kwargs)
        finally:
            torch.Tensor.tolist = tolist
        if per_step and tree:
            record["tree_steps"].append(sorted(guard.ops.items()))
        return result

    return run


def install(worker) -> None:
    runner = worker.model_runner
    record = runner._step_guard = {"reads": [], "tree_steps": []}
    verifier = runner.rejection_sampler
    verifier.forward = _guarded(verifier.forward, record, per_step=True)
    runner._set_depth_positions = _guarded(runner._set_depth_positions, record, per_step=False)


def report(worker) -> dict:
    return worker.model_runner._step_guard
