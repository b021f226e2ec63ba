"""CUDA graphs around tree steps.

A branching tree's rows attend through the plugin's tree path, Python that a
FULL CUDA graph never runs (its replay repeats the stock kernel it captured).
So a step whose trees branch may not replay a FULL graph: it runs PIECEWISE
(vLLM's attention ops sit between the graph's pieces and run eagerly, tree
path included) or, where no piecewise graph fits, eagerly. Every other step,
chains included (exact under the stock kernel), keeps vLLM's own choice, FULL
graphs too. On the CPU no graph is ever captured and this changes nothing.
"""

from __future__ import annotations

from vllm.config import CUDAGraphMode
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_adaptive_spec.adapter import step as tree_step


def branching_step() -> bool:
    """Whether the step now laid out has rows for the tree path."""
    current = tree_step.current()
    return isinstance(current, tree_step.TreeStep) and current.attention is not None


def graph_modes(valid_modes, invalid_modes, branching: bool):
    """The (valid, invalid) runtime modes to dispatch with: FULL is invalid for
    a branching step; when nothing else would be valid, the step runs eagerly."""
    if not branching:
        return valid_modes, invalid_modes
    invalid = {CUDAGraphMode.FULL} | set(invalid_modes or ())
    if valid_modes is not None and not set(valid_modes) - invalid:
        return {CUDAGraphMode.NONE}, invalid - {CUDAGraphMode.NONE}
    return valid_modes, invalid


class TreeCudagraphDispatcher(CudagraphDispatcher):
    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        valid_modes, invalid_modes = graph_modes(valid_modes, invalid_modes, branching_step())
        return super().dispatch(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)
