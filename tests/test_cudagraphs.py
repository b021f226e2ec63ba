"""Which CUDA graph a step replays: vLLM's dispatcher with the plugin's keys.

The dispatcher and the runner's graph choice are vLLM's own Python, the same
in its CPU and CUDA builds; here they run against a minimal config (no graph
is captured on a CPU), and the runner's base is a recorder of what vLLM's
``GPUModelRunner`` would be asked. The GPU engine tests replay the graphs.
"""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from vllm.config import CUDAGraphMode as Mode
from vllm.forward_context import BatchDescriptor

from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.adapter.cudagraphs import (
    DecodeGraphsMixin,
    TreeCudagraphDispatcher,
    is_plain_decode_key,
    plain_decode_keys,
)
from vllm_adaptive_spec.adapter.runner import TreeRunnerMixin
from vllm_adaptive_spec.config import TreeConfig
from vllm_adaptive_spec.step.modes import UniformLayout, UniformSteps
from vllm_adaptive_spec.trees.tree import DraftTree
from vllm_adaptive_spec.trees.tree_buffers import TreeBuffers
from vllm_adaptive_spec.trees.uniform_widths import plugin_batch_sizes, step_widths


def uniform_tree_rows(max_nodes: int, spec_tokens: int) -> frozenset[int]:
    """The rows a request of a uniform step can have, as the step mode gives them."""
    return UniformSteps(TreeConfig("retrieval", "retrieval", max_nodes), spec_tokens, (), True).tree_rows

SPEC_TOKENS = 16  # vLLM's uniform decode batches: 17 rows a request
SIZES = [17, 34, 51, 68]  # vLLM rounds capture sizes to multiples of 17 under speculation
MAX_SEQS = 64


def dispatcher(mode=Mode.FULL_AND_PIECEWISE, lora=None, sizes=SIZES, spec_tokens=SPEC_TOKENS,
               max_seqs=MAX_SEQS) -> TreeCudagraphDispatcher:
    compilation = SimpleNamespace(
        cudagraph_mode=mode, cudagraph_capture_sizes=list(sizes), max_cudagraph_capture_size=sizes[-1],
        compile_sizes=[], splitting_ops=[], mode=None, is_attention_compiled_piecewise=lambda: True,
        cudagraph_specialize_lora=False,
    )
    config = SimpleNamespace(compilation_config=compilation, num_speculative_tokens=spec_tokens, lora_config=lora,
                             scheduler_config=SimpleNamespace(max_num_seqs=max_seqs))
    result = TreeCudagraphDispatcher(config)
    result.initialize_cudagraph_keys(mode, 1 + spec_tokens)
    return result


def test_draft_free_decode_batches_get_full_graph_keys_beside_vllms():
    keys = dispatcher().cudagraph_keys[Mode.FULL]
    plain = {BatchDescriptor(num_tokens=n, num_reqs=n, uniform=True) for n in (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)}
    speculative = {BatchDescriptor(num_tokens=n, num_reqs=n // 17, uniform=True) for n in SIZES}
    assert keys == plain | speculative
    assert all(is_plain_decode_key(key) for key in plain) and not any(is_plain_decode_key(k) for k in speculative)


def vllm_capture_sizes(max_num_seqs: int, spec_tokens: int) -> list[int]:
    """vLLM 0.32's default capture sizes under speculation: its candidate
    list up to ``min(2 * max_num_seqs * (1 + K), 512)``, rounded by vLLM's own
    ``adjust_cudagraph_sizes_for_spec_decode``."""
    from vllm.config import CompilationConfig

    largest = min(2 * max_num_seqs * (1 + spec_tokens), 512)
    config = CompilationConfig()
    config.cudagraph_capture_sizes = [s for s in [1, 2, 4, *range(8, 256, 8), *range(256, 513, 16)] if s <= largest]
    config.max_cudagraph_capture_size = largest
    config.adjust_cudagraph_sizes_for_spec_decode(1 + spec_tokens)
    return config.cudagraph_capture_sizes


@pytest.mark.parametrize("max_seqs", [1, 8, 64, 256])
@pytest.mark.parametrize("config, spec_tokens", [("retrieval N=16", 16), ("eagle2 top-k 10 depth 8", 70),
                                                 ("talon N=32", 32)])
def test_every_draft_free_step_replays_a_full_graph(max_seqs, config, spec_tokens):
    """Every batch size a draft-free step can have finds a FULL
    key, whatever vLLM rounded its capture sizes to (with vLLM's sizes
    filtered to ``max_num_seqs``, batch 8 at K = 16 and every batch at K = 70
    had none)."""
    sizes = vllm_capture_sizes(max_seqs, spec_tokens)
    d = dispatcher(sizes=sizes, spec_tokens=spec_tokens, max_seqs=max_seqs)
    d.uniform_decode_query_len = 1  # as the runner sets it for a draft-free step
    for batch in range(1, max_seqs + 1):
        mode, key = d.dispatch(batch, uniform_decode=True)
        assert mode == Mode.FULL and key.num_reqs == key.num_tokens >= batch, (config, batch, key)
        assert key.num_reqs <= max_seqs and key.num_tokens <= sizes[-1]


def test_plugin_batch_sizes_follow_vllms_pattern_up_to_the_limit():
    assert plugin_batch_sizes(1, 512) == [1]
    assert plugin_batch_sizes(10, 512) == [1, 2, 4, 8, 10]
    assert plugin_batch_sizes(300, 512)[-4:] == [256, 272, 288, 300]
    assert plugin_batch_sizes(64, 40) == [1, 2, 4, 8, 16, 24, 32, 40]


@pytest.mark.parametrize("mode, spec_len, lora", [
    (Mode.PIECEWISE, 17, False),  # no FULL decode graphs at all
    (Mode.FULL, 17, False),  # one routine for every batch: vLLM keys it itself
    (Mode.FULL_AND_PIECEWISE, 1, False),  # no speculation: vLLM's own keys are these
    (Mode.FULL_AND_PIECEWISE, 17, True),  # LoRA: vLLM keys graphs per adapter count
])
def test_no_extra_keys_where_vllm_captures_no_separate_decode_graphs(mode, spec_len, lora):
    assert plain_decode_keys(mode, spec_len, SIZES[-1], MAX_SEQS, lora) == []


def test_a_draft_free_step_replays_a_full_graph_and_a_tree_step_does_not():
    d = dispatcher()
    # vLLM's view of a step of 8 requests one row each: not its uniform decode shape.
    assert d.dispatch(8, uniform_decode=False) == (Mode.PIECEWISE, BatchDescriptor(num_tokens=17))
    # The runner's view (one row a request): the FULL graph of 8 one-row requests; 7 pad to 8.
    d.uniform_decode_query_len = 1
    assert d.dispatch(8, uniform_decode=True) == (Mode.FULL, BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True))
    assert d.dispatch(7, uniform_decode=True) == (Mode.FULL, BatchDescriptor(num_tokens=8, num_reqs=8, uniform=True))
    d.uniform_decode_query_len = 17
    # A chain step of 2 requests x 17 rows keeps vLLM's own FULL graph.
    assert d.dispatch(34, uniform_decode=True) == (Mode.FULL, BatchDescriptor(num_tokens=34, num_reqs=2, uniform=True))
    # A branching tree step never replays a FULL graph.
    branching = tree_step.TreeStep.__new__(tree_step.TreeStep)
    branching.attention = object()
    with tree_step.published(branching):
        assert d.dispatch(34, uniform_decode=True)[0] == Mode.PIECEWISE


class RecordingRunner:
    """What vLLM's runner is asked, and the uniform decode row count each call sees."""

    def __init__(self) -> None:
        self.uniform_decode_query_len = 1 + SPEC_TOKENS
        self.cudagraph_dispatcher = SimpleNamespace(uniform_decode_query_len=1 + SPEC_TOKENS, tree_rows=frozenset())
        self.seen = []
        self.published = []  # the step published during each capture

    def _determine_batch_execution_and_padding(self, **kwargs):
        self.seen.append(("step", self.uniform_decode_query_len, self.cudagraph_dispatcher.uniform_decode_query_len))

    def _warmup_and_capture(self, desc, **kwargs):
        self.seen.append(("capture", self.uniform_decode_query_len, self.cudagraph_dispatcher.uniform_decode_query_len))
        self.published.append(tree_step.current())


class Runner(DecodeGraphsMixin, RecordingRunner):
    def __init__(self) -> None:
        RecordingRunner.__init__(self)  # the mixin's own setup needs an engine's config


def test_the_runner_picks_and_captures_one_row_graphs_with_one_row_a_request():
    runner = Runner()
    step = dict(num_scheduled_tokens_np=None, use_cascade_attn=False)
    runner._determine_batch_execution_and_padding(num_tokens=8, num_reqs=8, max_num_scheduled_tokens=1, **step)
    runner._determine_batch_execution_and_padding(num_tokens=20, num_reqs=8, max_num_scheduled_tokens=5, **step)
    # A capture's dummy run decides its own shape (force_uniform_decode): left alone.
    runner._determine_batch_execution_and_padding(num_tokens=8, num_reqs=8, max_num_scheduled_tokens=1,
                                                  force_uniform_decode=False, **step)
    runner._warmup_and_capture(BatchDescriptor(num_tokens=17, num_reqs=17, uniform=True))
    runner._warmup_and_capture(BatchDescriptor(num_tokens=34, num_reqs=2, uniform=True))
    runner._warmup_and_capture(BatchDescriptor(num_tokens=17))
    assert runner.seen == [("step", 1, 1), ("step", 17, 17), ("step", 17, 17),
                           ("capture", 1, 1), ("capture", 17, 17), ("capture", 17, 17)]
    assert runner.uniform_decode_query_len == runner.cudagraph_dispatcher.uniform_decode_query_len == 17


def tree_dispatcher(max_seqs: int, max_nodes: int, spec_tokens: int, max_tokens: int = 8192) -> TreeCudagraphDispatcher:
    """The dispatcher as the runner sets it up with uniform tree steps on."""
    sizes = vllm_capture_sizes(max_seqs, spec_tokens)
    compilation = SimpleNamespace(
        cudagraph_mode=Mode.FULL_AND_PIECEWISE, cudagraph_capture_sizes=sizes, max_cudagraph_capture_size=sizes[-1],
        compile_sizes=[], splitting_ops=[], mode=None, is_attention_compiled_piecewise=lambda: True,
        cudagraph_specialize_lora=False,
    )
    config = SimpleNamespace(compilation_config=compilation, num_speculative_tokens=spec_tokens, lora_config=None,
                             scheduler_config=SimpleNamespace(max_num_seqs=max_seqs, max_num_batched_tokens=max_tokens))
    result = TreeCudagraphDispatcher(config)
    result.tree_rows = uniform_tree_rows(max_nodes, spec_tokens)
    result.initialize_cudagraph_keys(Mode.FULL_AND_PIECEWISE, 1 + spec_tokens)
    return result


@pytest.mark.parametrize("max_seqs", [1, 8, 64, 256])
@pytest.mark.parametrize("config, max_nodes, spec_tokens", [("retrieval N=16", 16, 16), ("eagle2 top-k 10 depth 8", 60, 70),
                                                         ("talon N=32", 32, 32)])
def test_every_uniform_tree_step_replays_a_full_graph(max_seqs, config, max_nodes, spec_tokens):
    """Every pure-decode step the plugin can produce with uniform
    steps on (one row a request, or ``1 + W`` for each width ``W`` of the
    ``max_nodes`` while the step fits the scheduler's token budget) finds a FULL
    key, padded to the plugin's batch sizes."""
    d = tree_dispatcher(max_seqs, max_nodes, spec_tokens)
    for width in (0, *step_widths(max_nodes)):
        rows = 1 + width
        d.uniform_decode_query_len = rows  # as the runner sets it for the step
        for batch in range(1, max_seqs + 1):
            if batch * rows > 8192:
                break  # the proposer never pads a step beyond the token budget
            mode, key = d.dispatch(batch * rows, uniform_decode=True)
            assert mode == Mode.FULL, (config, batch, rows)
            assert key.num_tokens == key.num_reqs * rows and batch <= key.num_reqs <= max_seqs


def test_a_branching_uniform_step_replays_its_full_graph():
    """A uniform step's trees run in the graph (the tree kernel is in it), so
    FULL stays valid although the trees branch (their rows for the tree
    path are there for a step no graph serves); without its graph-safe rows
    the same step may not replay FULL."""
    d = tree_dispatcher(64, 16, 16)
    d.uniform_decode_query_len = 5
    uniform = tree_step.TreeStep.__new__(tree_step.TreeStep)
    uniform.attention, uniform.uniform = object(), tree_step.UniformRows(torch.zeros(1, 1, dtype=torch.bool), 5)
    with tree_step.published(uniform):
        assert d.dispatch(7 * 5, uniform_decode=True) == (Mode.FULL, BatchDescriptor(num_tokens=40, num_reqs=8,
                                                                                     uniform=True))
    uniform.uniform = None
    with tree_step.published(uniform):
        assert d.dispatch(7 * 5, uniform_decode=True)[0] != Mode.FULL


class TreeGraphsRunnerBase(RecordingRunner):
    """The tree runner's own layout under the mixin (its vLLM parts faked)."""

    _set_depth_positions = TreeRunnerMixin._set_depth_positions
    _lay_out = TreeRunnerMixin._lay_out


class TreeGraphsRunner(DecodeGraphsMixin, TreeGraphsRunnerBase):
    def __init__(self) -> None:
        RecordingRunner.__init__(self)
        self.cudagraph_dispatcher.tree_rows = frozenset({3, 5, 17})
        self.uniform_mask = torch.zeros(64, 17, dtype=torch.bool)


def test_tree_graphs_are_picked_and_captured_with_the_tree_step_published():
    runner = TreeGraphsRunner()
    step = dict(num_scheduled_tokens_np=None, use_cascade_attn=False)
    runner._determine_batch_execution_and_padding(num_tokens=40, num_reqs=8, max_num_scheduled_tokens=5, **step)
    runner._determine_batch_execution_and_padding(num_tokens=32, num_reqs=8, max_num_scheduled_tokens=4, **step)
    runner._warmup_and_capture(BatchDescriptor(num_tokens=40, num_reqs=8, uniform=True))
    assert runner.seen[:3] == [("step", 5, 5), ("step", 17, 17), ("capture", 5, 5)]
    captured = runner.published[0]
    assert isinstance(captured, tree_step.UniformRows) and captured.rows == 5 and captured.mask is runner.uniform_mask
    assert tree_step.current() is None


def test_a_failed_capture_drops_its_key_and_the_step_runs_piecewise():
    runner = TreeGraphsRunner()
    key = BatchDescriptor(num_tokens=40, num_reqs=8, uniform=True)
    runner.cudagraph_dispatcher.cudagraph_keys = {Mode.FULL: {key}}

    def failing(desc, **kwargs):
        raise RuntimeError("operation not permitted when stream is capturing")

    RecordingRunner._warmup_and_capture, original = failing, RecordingRunner._warmup_and_capture
    try:
        assert runner._warmup_and_capture(key) is None
    finally:
        RecordingRunner._warmup_and_capture = original
    assert key not in runner.cudagraph_dispatcher.cudagraph_keys[Mode.FULL]


def test_a_uniform_steps_masks_reach_the_persistent_buffer():
    """A uniform step is laid out from the persistent tree buffers, every
    request's row masks (its tree's; causal for a request without one) reach
    the buffer the graphs read, node rows get their depth positions, and the
    step's rows are the graph-safe ones."""
    runner = TreeGraphsRunner()
    runner.input_batch = SimpleNamespace(num_reqs=3)
    runner._layout = UniformLayout(TreeBuffers(max_reqs=3, capacity=16, device=torch.device("cpu")))
    runner.device, runner.positions = torch.device("cpu"), torch.arange(9)
    tree = DraftTree(tokens=[5, 6], parents=[-1, -1], q=[0.6, 0.4])
    layout = ([0, 2], [tree, DraftTree.chain([7])], [0, 6], [3, 3], [0, 1])
    step = runner._lay_out(*layout, np.array([3, 3, 3]))
    assert step.uniform.rows == 3 and step.uniform.mask is runner.uniform_mask and runner._layout.steps == 1
    assert runner.uniform_mask[:9, :3].int().tolist() == [
        [1, 0, 0], [1, 1, 0], [1, 0, 1],  # the branching tree
        [1, 0, 0], [1, 1, 0], [1, 1, 1],  # no tree: causal
        [1, 0, 0], [1, 1, 0], [1, 0, 0],  # a chain of one, then a padding row
    ]
    assert runner.positions.tolist() == [0, 1, 1, 3, 4, 5, 6, 7, 8]  # siblings share a depth
    # A step that is not uniform keeps the ragged tree path.
    ragged = runner._lay_out(*layout, np.array([3, 1, 3]))
    assert ragged.uniform is None and ragged.attention is not None

