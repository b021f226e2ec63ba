"""A guard over the device part of every tree step of a real engine.

Installed in the engine's worker with ``collective_rpc(install)`` (the engine
job's ``step_guard``), it wraps the tree verifier's ``forward`` (target
tokens, acceptance, vLLM's output, KV compaction, the statistics' copy) and
the runner's depth positions, a uniform step's device layout
(``tree_step.uniform_layout``), and a model drafter's first pass over the
step's committed rows (``first_pass``), the start of its trees (``begin``)
and its draft loop (``growth.grow_layers``: every tree layer's layout, draft
forward and policy). Inside, a dispatch mode records every torch
operation whose caller (the innermost frame outside torch) is the plugin's
code, and every read of a tensor's value by that code: what ``item``,
``bool``, ``int`` and ``nonzero`` dispatch, and ``Tensor.tolist`` (which
dispatches nothing); the CPU's own KV compaction (``HOST_ONLY``), which
never runs on a GPU, is left out, and so is the CPU's draft attention (a
GPU's kernel reads the pages where they are). On a GPU each such read would
make the host wait for the device in the middle of the step. ``report``
returns the reads and, per tree step, first pass and draft loop, the
operations dispatched.
"""

from __future__ import annotations

import importlib
import sys
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

PLUGIN = ("/vllm_adaptive_spec/", "/kernels/")
# Code that runs only where there is no device, so reading a value there waits for nothing
# (everything it calls included): the CPU's KV compaction finds its moving pairs on the host,
# where they already are; the CPU's draft attention groups the step's contexts by length.
# ``install`` wraps them; while one runs, nothing is recorded.
HOST_ONLY = (("kernels.kv_compaction", "compact_kv_cpu"),
             ("vllm_adaptive_spec.adapter.attention_cpu", "draft_pass_attention"))
_host_only_depth = [0]
# ``item`` is what a read dispatches under inference mode (the engine's), ``_local_scalar_dense`` outside it.
READS = ("aten.item", "_local_scalar_dense", "nonzero", "is_nonzero")


def plugin_caller() -> str | None:
    """``file:line`` of the innermost caller outside torch and this file, if it is the plugin's."""
    if _host_only_depth[0]:
        return None
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "/torch/" not in name and not name.endswith("step_guard.py"):
            return f"{name}:{frame.f_lineno}" if any(part in name for part in PLUGIN) else None
        frame = frame.f_back
    return None


def _host_only(function):
    def run(*args, **kwargs):
        _host_only_depth[0] += 1
        try:
            return function(*args, **kwargs)
        finally:
            _host_only_depth[0] -= 1

    return run


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


def _guarded(function, record, steps: str | None):
    """``function`` under the guard; the operations of each call go to
    ``record[steps]`` (for the tree verifier: each call with trees)."""

    def run(*args, **kwargs):
        from vllm_adaptive_spec.step import tree_step

        current = tree_step.current()
        tree = steps in ("draft_loops", "first_passes", "layouts") or (isinstance(current, tree_step.TreeStep)
                                                             and bool(current.trees))
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
        if steps is not None and tree:
            record[steps].append(sorted(guard.ops.items()))
        return result

    return run


def install(worker) -> None:
    runner = worker.model_runner
    record = runner._step_guard = {"reads": [], "tree_steps": [], "draft_loops": [], "first_passes": [], "layouts": []}
    for module_name, name in HOST_ONLY:
        module = importlib.import_module(module_name)
        setattr(module, name, _host_only(getattr(module, name)))
    verifier = runner.rejection_sampler
    verifier.forward = _guarded(verifier.forward, record, "tree_steps")
    runner._set_depth_positions = _guarded(runner._set_depth_positions, record, None)
    from vllm_adaptive_spec.step import tree_step

    tree_step.uniform_layout = _guarded(tree_step.uniform_layout, record, "layouts")  # a uniform step's device layout
    if runner._draft_backend is not None:
        from vllm_adaptive_spec.step import growth

        growth.grow_layers = _guarded(growth.grow_layers, record, "draft_loops")
        backend = runner._draft_backend
        backend.first_pass = _guarded(backend.first_pass, record, "first_passes")
        backend.begin = _guarded(backend.begin, record, None)


def report(worker) -> dict:
    return worker.model_runner._step_guard
