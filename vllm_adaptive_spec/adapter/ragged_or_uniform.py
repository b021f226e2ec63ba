"""The engine's step mode, decided once with the config and the engine:
ragged or uniform steps (:mod:`~vllm_adaptive_spec.step.modes`).
The ``step_shape`` setting chooses (``auto``: uniform where CUDA graphs
replay steps, ragged elsewhere); :func:`resolve` is the one place that reads
it, for the worker (proposer, runner, draft backend) and the scheduler alike.
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.step.modes import RaggedSteps, UniformSteps
from vllm_adaptive_spec.trees.uniform_widths import plugin_batch_sizes


def graphs_replay(vllm_config, device_type: str) -> bool:
    """Whether CUDA graphs replay this engine's steps."""
    if device_type != "cuda":
        return False
    from vllm.config import CUDAGraphMode

    mode = vllm_config.compilation_config.cudagraph_mode
    return mode is not None and mode != CUDAGraphMode.NONE


def resolve(config, vllm_config) -> RaggedSteps | UniformSteps:
    """The engine's step mode, from ``step_shape``, the platform and the graph mode."""
    graphs = graphs_replay(vllm_config, torch.device(vllm_config.device_config.device_type).type)
    if config.step_shape == "ragged" or (config.step_shape == "auto" and not graphs):
        return RaggedSteps(config)
    sizes = ()
    if graphs:
        compilation, scheduler = vllm_config.compilation_config, vllm_config.scheduler_config
        sizes = tuple(plugin_batch_sizes(scheduler.max_num_seqs, compilation.max_cudagraph_capture_size or 0))
    return UniformSteps(config, vllm_config.speculative_config.num_speculative_tokens, sizes, graphs)
