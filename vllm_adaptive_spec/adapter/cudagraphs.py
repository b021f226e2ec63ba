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
(``uniform_widths.plugin_batch_sizes``) and dispatch draft-free decode steps to them,
so such a step is vLLM's own step without speculation.

Uniform tree steps (the step mode's, ``ragged_or_uniform``, where graphs replay).
A drafting step whose every request has ``R = 1 + W`` rows is
keyed ``(b * R, b, uniform)`` for every plugin batch size ``b`` and every
width ``W`` (vLLM's own ``R = 1 + num_speculative_tokens`` too) and replays
a FULL graph in which every attention layer runs the tree kernel's
graph-safe launch over all rows (``TreeImplMixin``), reading its masks from
one persistent buffer the runner fills on the device before the step, from
the trees in the persistent tree buffers (``tree_buffers``;
:class:`~vllm_adaptive_spec.step.tree_step.UniformRows`). So these graphs are
captured with that step published: a graph captured without it would have
frozen vLLM's causal kernel in. A capture that fails drops its key (the
step then runs PIECEWISE) with one log line.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import replace

import torch
from vllm.config import CUDAGraphMode
from vllm.logger import init_logger
from vllm.forward_context import BatchDescriptor
from vllm.v1.cudagraph_dispatcher import CudagraphDispatcher

from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.trees.uniform_widths import plugin_batch_sizes, uniform_rows

logger = init_logger(__name__)


def branching_step() -> bool:
    """Whether the step now laid out has rows for the tree path and no
    graph-safe launch (``TreeStep.uniform``) that a FULL graph replays."""
    current = tree_step.current()
    return isinstance(current, tree_step.TreeStep) and current.attention is not None and current.uniform is None


def graph_modes(valid_modes, invalid_modes, branching: bool):
    """The (valid, invalid) runtime modes to dispatch with: FULL is invalid for
    a branching step; when nothing else would be valid, the step runs eagerly."""
    if not branching:
        return valid_modes, invalid_modes
    invalid = {CUDAGraphMode.FULL} | set(invalid_modes or ())
    if valid_modes is not None and not set(valid_modes) - invalid:
        return {CUDAGraphMode.NONE}, invalid - {CUDAGraphMode.NONE}
    return valid_modes, invalid


def plain_decode_keys(cudagraph_mode: CUDAGraphMode, uniform_decode_query_len: int, max_tokens: int,
                      max_num_seqs: int, has_lora_config: bool) -> list[BatchDescriptor]:
    """The FULL-graph keys of draft-free decode batches (one row a request)
    to capture beside vLLM's: one per ``uniform_widths.plugin_batch_sizes``, where vLLM
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


def tree_step_keys(tree_rows: frozenset[int], max_num_seqs: int, max_tokens: int) -> list[BatchDescriptor]:
    """FULL keys of uniform tree steps: ``R`` rows a request for every ``R``
    in ``tree_rows``, at every plugin batch size whose step fits
    ``max_tokens`` (the scheduler's token budget)."""
    return [BatchDescriptor(num_tokens=size * rows, num_reqs=size, uniform=True)
            for rows in sorted(tree_rows) for size in plugin_batch_sizes(max_num_seqs, max_tokens // rows)]


def is_plain_decode_key(desc: BatchDescriptor) -> bool:
    """Whether ``desc`` is one of :func:`plain_decode_keys` (vLLM's own
    uniform keys have ``num_reqs < num_tokens`` under speculation)."""
    return desc.uniform and desc.num_reqs == desc.num_tokens


class TreeCudagraphDispatcher(CudagraphDispatcher):
    """vLLM's dispatcher with the draft-free keys; a draft-free step (the
    runner sets ``uniform_decode_query_len`` to 1 for it) is padded to the
    next of the plugin's batch sizes, not to vLLM's rounded capture sizes."""

    plain_sizes: tuple[int, ...] = ()
    tree_rows: frozenset[int] = frozenset()  # set by the runner when uniform tree steps are on
    tree_sizes: dict[int, tuple[int, ...]] = {}

    def initialize_cudagraph_keys(self, cudagraph_mode, uniform_decode_query_len=1):
        super().initialize_cudagraph_keys(cudagraph_mode, uniform_decode_query_len)
        scheduler = self.vllm_config.scheduler_config
        keys = plain_decode_keys(cudagraph_mode, uniform_decode_query_len,
                                 self.compilation_config.max_cudagraph_capture_size,
                                 scheduler.max_num_seqs, self.vllm_config.lora_config is not None)
        self.plain_sizes = tuple(key.num_reqs for key in keys)
        if keys and self.tree_rows:
            tree_keys = tree_step_keys(self.tree_rows, scheduler.max_num_seqs, scheduler.max_num_batched_tokens)
            self.tree_sizes = {rows: tuple(k.num_reqs for k in tree_keys if k.num_tokens == k.num_reqs * rows)
                               for rows in self.tree_rows}
            keys += tree_keys
        for key in keys:
            self.add_cudagraph_key(CUDAGraphMode.FULL, key)

    def _create_padded_batch_descriptor(self, num_tokens, uniform_decode, has_lora, num_active_loras=0):
        rows = self.uniform_decode_query_len
        sizes = self.plain_sizes if rows == 1 else self.tree_sizes.get(rows, ())
        if uniform_decode and sizes:
            size = next((size for size in sizes if size * rows >= num_tokens), None)
            if size is not None:
                return BatchDescriptor(num_tokens=size * rows, num_reqs=size, uniform=True, has_lora=has_lora,
                                       num_active_loras=num_active_loras)
        return super()._create_padded_batch_descriptor(num_tokens, uniform_decode, has_lora, num_active_loras)

    def dispatch(self, num_tokens, uniform_decode=False, has_lora=False, num_active_loras=0,
                 valid_modes=None, invalid_modes=None):
        valid_modes, invalid_modes = graph_modes(valid_modes, invalid_modes, branching_step())
        rows = self.uniform_decode_query_len
        if uniform_decode and rows > 1 and rows in self.tree_rows and self.keys_initialized:
            # vLLM refuses steps beyond its own largest capture size before looking at keys.
            allowed = (valid_modes or CUDAGraphMode.valid_runtime_modes()) - set(invalid_modes or ())
            key = self._create_padded_batch_descriptor(num_tokens, True, has_lora, num_active_loras)
            if CUDAGraphMode.FULL in allowed and key in self.cudagraph_keys[CUDAGraphMode.FULL]:
                return CUDAGraphMode.FULL, key
        return super().dispatch(num_tokens, uniform_decode, has_lora, num_active_loras, valid_modes, invalid_modes)


class DecodeGraphsMixin:
    """Mixed in before the tree runner over vLLM's ``GPUModelRunner`` (with
    :class:`TreeCudagraphDispatcher` as its dispatcher): captures and
    replays the FULL graphs of draft-free decode steps and, with uniform
    steps on, of uniform tree steps. Both vLLM paths that pick a graph, a
    step's ``_determine_batch_execution_and_padding`` and the capture's
    ``_warmup_and_capture``, read the uniform decode row count from the
    runner and its dispatcher; for those steps and keys it is their own."""

    uniform_mask: torch.Tensor | None = None  # [max tokens, max rows]: each row's visible rows

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        rows = self.tree_proposer.mode.graph_tree_rows
        if not rows:
            return
        self.cudagraph_dispatcher.tree_rows = rows
        max_tokens = vllm_config.scheduler_config.max_num_batched_tokens
        # Every row sees its request's root: a graph replayed for placeholder drafts only
        # (vLLM's, whose token comes from the root's row) reads the buffer as it was.
        self.uniform_mask = torch.zeros(max_tokens, max(rows), dtype=torch.bool, device=device)
        self.uniform_mask[:, 0] = True

    @contextmanager
    def _rows_a_request(self, rows: int):
        runner_len = self.uniform_decode_query_len
        dispatcher_len = self.cudagraph_dispatcher.uniform_decode_query_len
        self.uniform_decode_query_len = self.cudagraph_dispatcher.uniform_decode_query_len = rows
        try:
            yield
        finally:
            self.uniform_decode_query_len = runner_len
            self.cudagraph_dispatcher.uniform_decode_query_len = dispatcher_len

    def _own_rows(self, rows: int | None) -> bool:
        """Whether steps of ``rows`` rows a request take the plugin's keys."""
        if rows == 1:
            return self.uniform_decode_query_len > 1
        return rows is not None and rows in self.cudagraph_dispatcher.tree_rows

    def _determine_batch_execution_and_padding(self, **kwargs):
        rows = uniform_rows(kwargs["max_num_scheduled_tokens"], kwargs["num_tokens"], kwargs["num_reqs"])
        if kwargs.get("force_uniform_decode") is None and self._own_rows(rows):
            with self._rows_a_request(rows):
                return super()._determine_batch_execution_and_padding(**kwargs)
        return super()._determine_batch_execution_and_padding(**kwargs)

    def _warmup_and_capture(self, desc, *args, **kwargs):
        rows = desc.num_tokens // desc.num_reqs if desc.uniform and desc.num_reqs else None
        if not self._own_rows(rows):
            return super()._warmup_and_capture(desc, *args, **kwargs)
        if rows == 1:
            with self._rows_a_request(1):
                return super()._warmup_and_capture(desc, *args, **kwargs)
        with self._rows_a_request(rows), tree_step.published(tree_step.UniformRows(self.uniform_mask, rows)):
            try:
                return super()._warmup_and_capture(desc, *args, **kwargs)
            except Exception as exc:  # noqa: BLE001 - any capture failure leaves the step to PIECEWISE
                self.cudagraph_dispatcher.cudagraph_keys[CUDAGraphMode.FULL].discard(desc)
                logger.warning("adaptive_tree: capturing the tree step %s failed (%s); it runs PIECEWISE", desc, exc)
                return None

    def _uniform_graph_rows(self, num_scheduled_tokens) -> int | None:
        """The rows a request of this step has, if it is a uniform tree step
        the captured graphs serve (every request the same ``1 + W`` rows)."""
        num_reqs = self.input_batch.num_reqs
        rows = self._layout.uniform_rows(num_scheduled_tokens, num_reqs)
        if self.uniform_mask is None or rows not in self.cudagraph_dispatcher.tree_rows:
            return None
        return rows

    def _lay_out(self, batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens):
        """A uniform tree step a captured graph serves (laid out from the
        persistent tree buffers by the step mode) also gets every request's
        row masks (its tree's, causal for a request without one) in the
        persistent buffer the graphs read."""
        step = super()._lay_out(batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens)
        rows = self._uniform_graph_rows(num_scheduled_tokens)
        if rows is None:
            return step
        num_reqs = self.input_batch.num_reqs
        masks = self.uniform_mask[: num_reqs * rows, :rows].view(num_reqs, rows, rows)
        masks.copy_(torch.ones(rows, rows, dtype=torch.bool, device=masks.device).tril())
        masks.index_copy_(0, step.batch_indices, step.query_mask.view(-1, rows, rows))
        return replace(step, uniform=tree_step.UniformRows(self.uniform_mask, rows))
