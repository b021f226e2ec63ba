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
num_speculative_tokens)``) for every batch size up to ``max_num_seqs``
(:func:`plugin_batch_sizes`) and dispatch draft-free decode steps to them,
so such a step is vLLM's own step without speculation.
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


def plugin_batch_sizes(max_num_seqs: int, max_tokens: int) -> list[int]:
    """The batch sizes the plugin captures its draft-free FULL graphs for, in
    vLLM's default pattern without speculation (1, 2, 4, every 8 to 256,
    every 16 beyond) up to ``max_num_seqs`` and ``max_tokens`` (vLLM's
    largest capture size, beyond which it dispatches no graph), that limit
    itself included. Decision: the plugin's own list, since vLLM's sizes are
    rounded to multiples of ``1 + num_speculative_tokens`` under speculation
    (with 16 drafts and ``max_num_seqs`` 8 not one of them would be a batch
    size)."""
    limit = min(max_num_seqs, max_tokens)
    pattern = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    return sorted({size for size in pattern if size < limit} | {limit}) if limit >= 1 else []


def plain_decode_keys(cudagraph_mode: CUDAGraphMode, uniform_decode_query_len: int, max_tokens: int,
                      max_num_seqs: int, has_lora_config: bool) -> list[BatchDescriptor]:
    """The FULL-graph keys of draft-free decode batches (one row a request)
    to capture beside vLLM's: one per :func:`plugin_batch_sizes`, where vLLM
    captures FULL decode graphs for speculative steps (a FULL decode mode of
    its own routine) and a step of one row a request is not one of them
    (``uniform_decode_query_len`` > 1). None with LoRA, whose graphs vLLM
    keys per adapter count."""
    if (
        cudagraph_mode.decode_mode() != CUDAGraphMode.FULL
        or not cudagraph_mode.separate_routine()
        or uniform_decode_query_len <= 1
        or has_lora_config
    ):
        return []
    return [BatchDescriptor(num_tokens=size, num_reqs=size, uniform=True)
            for size in plugin_batch_sizes(max_num_seqs, max_tokens or 0)]


def is_plain_decode_key(desc: BatchDescriptor) -> bool:
    """Whether ``desc`` is one of :func:`plain_decode_keys` (vLLM's own
    uniform keys have ``num_reqs < num_tokens`` under speculation)."""
    return desc.uniform and desc.num_reqs == desc.num_tokens


def plain_decode_step(max_query_len: int, num_tokens: int, num_reqs: int) -> bool:
    """Whether a step is draft-free decoding: every request one row."""
    return max_query_len == 1 and num_tokens == num_reqs


class TreeCudagraphDispatcher(CudagraphDispatcher):
    """vLLM's dispatcher with the draft-free keys; a draft-free step (the
    runner sets ``uniform_decode_query_len`` to 1 for it) is padded to the
    next of the plugin's batch sizes, not to vLLM's rounded capture sizes."""

    plain_sizes: tuple[int, ...] = ()

    def initialize_cudagraph_keys(self, cudagraph_mode, uniform_decode_query_len=1):
        super().initialize_cudagraph_keys(cudagraph_mode, uniform_decode_query_len)
        keys = plain_decode_keys(cudagraph_mode, uniform_decode_query_len,
                                 self.compilation_config.max_cudagraph_capture_size,
                                 self.vllm_config.scheduler_config.max_num_seqs,
                                 self.vllm_config.lora_config is not None)
        for key in keys:
            self.add_cudagraph_key(CUDAGraphMode.FULL, key)
        self.plain_sizes = tuple(key.num_reqs for key in keys)

    def _create_padded_batch_descriptor(self, num_tokens, uniform_decode, has_lora, num_active_loras=0):
        if uniform_decode and self.uniform_decode_query_len == 1 and self.plain_sizes:
            size = next((size for size in self.plain_sizes if size >= num_tokens), None)
            if size is not None:
                return BatchDescriptor(num_tokens=size, num_reqs=size, uniform=True, has_lora=has_lora,
                                       num_active_loras=num_active_loras)
        return super()._create_padded_batch_descriptor(num_tokens, uniform_decode, has_lora, num_active_loras)

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
