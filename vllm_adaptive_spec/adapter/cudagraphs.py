"""CUDA graphs around tree steps, and FULL graphs for draft-free steps.

A branching tree's rows attend through the plugin's tree path, Python that a
FULL CUDA graph never runs (its replay repeats the stock kernel it captured).
So a step whose trees branch may not replay a FULL graph: it runs PIECEWISE
(vLLM's attention ops sit between the graph's pieces and run eagerly, tree
path included) or, where no piecewise graph fits, eagerly. Every other step,
chains included (exact under the stock kernel), keeps vLLM's own choice, FULL
graphs too. On the CPU no graph is ever captured and this changes nothing.

Draft-free decode steps. vLLM captures its FULL decode graphs for uniform
batches of ``1 + num_speculative_tokens`` rows a request, the shape of its
own chain drafters' steps. A tree step is never that shape, and a step in
which the load budget drafts nothing (one row a request, most steps where
trees do not pay) is not either, so vLLM runs it PIECEWISE: every attention
layer eagerly between the graph's pieces, with the plugin's impl around it.
On an H200 at batch 8 that step took 15.4 ms against 3.5 ms for the same
step without speculation. Decision: capture FULL graphs for one-row-a-request
decode batches too (keys ``num_tokens == num_reqs``, ``uniform``; they never
collide with vLLM's, whose ``num_reqs`` is ``num_tokens / (1 +
num_speculative_tokens)``) and dispatch draft-free decode steps to them, so
such a step is vLLM's own step without speculation.
"""

from __future__ import annotations

from contextlib import contextmanager

from vllm.config import CUDAGraphMode
from vllm.forward_context import BatchDescriptor
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


def plain_decode_keys(cudagraph_mode: CUDAGraphMode, uniform_decode_query_len: int, capture_sizes,
                      max_num_seqs: int, has_lora_config: bool) -> list[BatchDescriptor]:
    """The FULL-graph keys of draft-free decode batches (one row a request)
    to capture beside vLLM's: one per capture size up to ``max_num_seqs``,
    where vLLM captures FULL decode graphs for speculative steps (a FULL
    decode mode of its own routine) and a step of one row a request is not
    one of them (``uniform_decode_query_len`` > 1). None with LoRA, whose
    graphs vLLM keys per adapter count."""
    if (
        cudagraph_mode.decode_mode() != CUDAGraphMode.FULL
        or not cudagraph_mode.separate_routine()
        or uniform_decode_query_len <= 1
        or has_lora_config
    ):
        return []
    return [BatchDescriptor(num_tokens=size, num_reqs=size, uniform=True)
            for size in capture_sizes or () if size <= max_num_seqs]


def is_plain_decode_key(desc: BatchDescriptor) -> bool:
    """Whether ``desc`` is one of :func:`plain_decode_keys` (vLLM's own
    uniform keys have ``num_reqs < num_tokens`` under speculation)."""
    return desc.uniform and desc.num_reqs == desc.num_tokens


def plain_decode_step(max_query_len: int, num_tokens: int, num_reqs: int) -> bool:
    """Whether a step is draft-free decoding: every request one row."""
    return max_query_len == 1 and num_tokens == num_reqs


class TreeCudagraphDispatcher(CudagraphDispatcher):
    def initialize_cudagraph_keys(self, cudagraph_mode, uniform_decode_query_len=1):
        super().initialize_cudagraph_keys(cudagraph_mode, uniform_decode_query_len)
        for key in plain_decode_keys(cudagraph_mode, uniform_decode_query_len,
                                     self.compilation_config.cudagraph_capture_sizes,
                                     self.vllm_config.scheduler_config.max_num_seqs,
                                     self.vllm_config.lora_config is not None):
            self.add_cudagraph_key(CUDAGraphMode.FULL, key)

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        valid_modes, invalid_modes = graph_modes(valid_modes, invalid_modes, branching_step())
        return super().dispatch(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)


class PlainDecodeGraphsMixin:
    """Mixed in before vLLM's ``GPUModelRunner`` (with
    :class:`TreeCudagraphDispatcher` as its dispatcher): captures and
    replays the FULL graphs of draft-free decode steps. Both vLLM paths that
    pick a graph, a step's ``_determine_batch_execution_and_padding`` and the
    capture's ``_warmup_and_capture``, read the uniform decode row count from
    the runner and its dispatcher; for those steps and keys it is 1."""

    @contextmanager
    def _one_row_a_request(self):
        runner_len = self.uniform_decode_query_len
        dispatcher_len = self.cudagraph_dispatcher.uniform_decode_query_len
        self.uniform_decode_query_len = self.cudagraph_dispatcher.uniform_decode_query_len = 1
        try:
            yield
        finally:
            self.uniform_decode_query_len = runner_len
            self.cudagraph_dispatcher.uniform_decode_query_len = dispatcher_len

    def _determine_batch_execution_and_padding(self, **kwargs):
        if kwargs.get("force_uniform_decode") is None and self.uniform_decode_query_len > 1 and plain_decode_step(
            kwargs["max_num_scheduled_tokens"], kwargs["num_tokens"], kwargs["num_reqs"]
        ):
            with self._one_row_a_request():
                return super()._determine_batch_execution_and_padding(**kwargs)
        return super()._determine_batch_execution_and_padding(**kwargs)

    def _warmup_and_capture(self, desc, *args, **kwargs):
        if is_plain_decode_key(desc) and self.uniform_decode_query_len > 1:
            with self._one_row_a_request():
                return super()._warmup_and_capture(desc, *args, **kwargs)
        return super()._warmup_and_capture(desc, *args, **kwargs)
