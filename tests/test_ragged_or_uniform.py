"""The step mode, resolved once with the config (no engine): ragged steps on
the CPU by default, uniform ones where CUDA graphs replay or when asked,
each with its own cost model, layout and draft-layer runner."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.config import CUDAGraphMode

from vllm_adaptive_spec.adapter.ragged_or_uniform import resolve
from vllm_adaptive_spec.budget.cost_fit import StepCostFit
from vllm_adaptive_spec.budget.cost_models import LinearCost, ShapeCost
from vllm_adaptive_spec.config import TreeConfig
from vllm_adaptive_spec.step.draft_layers import FixedLayers, RaggedLayers
from vllm_adaptive_spec.step.modes import RaggedLayout, UniformLayout
from vllm_adaptive_spec.trees.uniform_widths import padded_rows


def engine(device: str, graphs: CUDAGraphMode | None, spec_tokens: int = 16, max_seqs: int = 8):
    return SimpleNamespace(
        device_config=SimpleNamespace(device_type=device),
        compilation_config=SimpleNamespace(cudagraph_mode=graphs, max_cudagraph_capture_size=512),
        scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
        speculative_config=SimpleNamespace(num_speculative_tokens=spec_tokens),
    )


@pytest.mark.parametrize("setting, device, graphs, uniform", [
    ("auto", "cpu", None, False),
    ("auto", "cuda", CUDAGraphMode.NONE, False),
    ("auto", "cuda", CUDAGraphMode.FULL_AND_PIECEWISE, True),
    ("uniform", "cpu", None, True),
    ("ragged", "cuda", CUDAGraphMode.FULL_AND_PIECEWISE, False),
])
def test_the_mode_follows_the_setting_the_platform_and_the_graphs(setting, device, graphs, uniform):
    config = TreeConfig("eagle3", "eagle2", 16, step_shape=setting)
    mode = resolve(config, engine(device, graphs))
    assert mode.uniform == uniform
    cost = mode.cost_model(StepCostFit())
    assert isinstance(cost, ShapeCost if uniform else LinearCost)
    assert isinstance(mode.layout(8, "cpu"), UniformLayout if uniform else RaggedLayout)
    layers = mode.draft_layers("cpu")
    assert isinstance(layers, FixedLayers if uniform else RaggedLayers)
    # Graph keys only where graphs replay; without them a uniform step's draft forwards are padded here.
    replayed = uniform and graphs not in (None, CUDAGraphMode.NONE)
    assert bool(mode.graph_tree_rows) == replayed
    assert layers.padded == (uniform and not replayed)


def test_a_uniform_mode_pads_drafts_to_its_widths_and_keeps_vllms_own_rows():
    mode = resolve(TreeConfig("retrieval", "retrieval", 16, step_shape="uniform"), engine("cpu", None, 20))
    assert mode.widths == (2, 4, 8, 16) and mode.tree_rows == {3, 5, 9, 17, 21} and mode.capacity == 20
    assert mode.scheduled([[5, 6, 7], []], [True, True], 4096) == [[5, 6, 7, -1], [-1, -1, -1, -1]]
    ragged = resolve(TreeConfig("retrieval", "retrieval", 16), engine("cpu", None))
    assert ragged.scheduled([[5, 6, 7], []], [True, True], 4096) == [[5, 6, 7], []]


def test_the_fixed_loop_only_for_drafters_that_grow_at_fixed_capacity():
    cpu = engine("cpu", None)
    layers = {(drafter, params.get("matcher")): resolve(TreeConfig(drafter, "eagle2", 16, params, step_shape="uniform"),
                                                         cpu).draft_layers("cpu")
              for drafter, params in (("hybrid", {"matcher": "trie"}), ("hybrid", {"matcher": "tensors"}),
                                      ("eagle3", {}), ("draft_model", {}))}
    assert [type(v) for v in layers.values()] == [RaggedLayers, FixedLayers, FixedLayers, FixedLayers]
    assert isinstance(resolve(TreeConfig("eagle3", "eagle2", 16, step_shape="ragged"), cpu).draft_layers("cpu"),
                      RaggedLayers)


def test_padded_draft_forwards_take_the_next_batch_size_and_count():
    layers = FixedLayers(torch.device("cpu"), padded=True)
    assert [layers.pass_rows(n, n, 64) for n in (1, 3, 5, 9, 64, 70)] == [1, 4, 8, 16, 64, 70]
    assert layers.padded_passes == 3
    assert layers.pass_rows(5, 16, 64) == 16  # a graph's own padding stays
    assert padded_rows(30, 24) == 30  # beyond the buffers: as it is
