"""The native CPU tree attention gives ``kernels.tree_attention``'s reference
results over vLLM's ``vec`` cache layout, in every build this machine runs:
ragged batches, keys cut mid-page, 1 to 2,000 keys, wide trees, windows wider
than the query (tree drafting), grouped-query attention, every head size vLLM's
CPU attention accepts, float32 and bfloat16, one thread and two; and where it
cannot be built the torch path stands in, with one warning."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels import cpu_library
from kernels import tree_attention_cpu as native
from kernels.tree_attention import tree_attention_reference
from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views

RUNNABLE = {"avx512": ("avx512", "avx2", "baseline"), "avx2": ("avx2", "baseline")}.get(native.machine_isa(),
                                                                                         ("baseline",))
HEAD_SIZES = (32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512)  # vLLM's CPU attention's
REPO = Path(__file__).resolve().parents[2]


def _tree_mask(rng: torch.Generator, rows: int, width: int) -> torch.Tensor:
    """``[rows, width]`` ancestor-or-self bits of a random tree whose last
    ``rows`` nodes are queried among ``width`` (a node's parent precedes it)."""
    parents = [-1] + [int(torch.randint(0, i, (1,), generator=rng)) for i in range(1, width)]
    mask = torch.zeros(width, width, dtype=torch.bool)
    for node, parent in enumerate(parents):
        if parent >= 0:
            mask[node] = mask[parent]
        mask[node, node] = True
    return mask[width - rows:]


def _case(seed, lengths, rows, heads=3, group=3, head_size=64, block_size=128, dtype=torch.float32, extra_window=0):
    """A batch: request ``b`` holds ``lengths[b]`` keys and ``rows[b]`` query
    rows, the last ``rows[b] + extra_window`` keys its tree's window."""
    rng = torch.Generator().manual_seed(seed)
    blocks = -(-max(lengths) // block_size)
    num_blocks = len(lengths) * blocks + 3
    cache = torch.randn(num_blocks, heads, block_size, 2 * head_size, generator=rng).to(dtype)
    block_table = torch.randperm(num_blocks, generator=rng)[: len(lengths) * blocks].view(len(lengths), blocks)
    windows = [min(r + extra_window, n) for r, n in zip(rows, lengths)]
    width = max(windows)
    masks = [torch.nn.functional.pad(_tree_mask(rng, r, w), (0, width - w)) for r, w in zip(rows, windows)]
    query = torch.randn(sum(rows), heads * group, head_size, generator=rng).to(dtype)
    starts = torch.tensor([0, *torch.tensor(rows).cumsum(0).tolist()], dtype=torch.int32)
    metadata = native.NativeRows.of(block_table.int(), starts, torch.tensor(lengths, dtype=torch.int32),
                                    torch.cat(masks), torch.tensor(windows, dtype=torch.int32))
    return query, cache, metadata


def _expected(query, cache, rows: native.NativeRows, scale):
    keys, values = cache_views(cache)
    return tree_attention_reference(query, keys, values, rows.block_table, rows.query_start_loc, rows.seq_lens,
                                    rows.query_mask, scale, rows.window_lens)


def _check(isa, query, cache, rows, threads=2):
    scale = query.shape[-1] ** -0.5
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = native.tree_attention_cpu(native.build(isa), query, cache, rows, scale)
    finally:
        torch.set_num_threads(before)
    tolerance = 2e-5 if query.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), _expected(query, cache, rows, scale).float(), atol=tolerance,
                               rtol=tolerance)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("threads", [1, 2])
def test_ragged_batches_match_the_reference(isa, dtype, threads):
    """Requests of 1 to 2,000 keys, cut anywhere in a page, with 1 to 24 rows."""
    lengths = [1, 7, 128, 129, 300, 2000, 45]
    rows = [1, 4, 16, 24, 5, 16, 1]
    _check(isa, *_case(0, lengths, rows, dtype=dtype), threads=threads)


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("head_size", HEAD_SIZES)
def test_every_head_size(isa, head_size):
    _check(isa, *_case(1, [300, 61], [6, 3], heads=2, group=2, head_size=head_size, block_size=32))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("heads,group", [(1, 1), (4, 1), (2, 4), (1, 8), (3, 3)])
def test_grouped_query_attention(isa, heads, group):
    _check(isa, *_case(2, [200, 33, 512], [3, 8, 2], heads=heads, group=group, block_size=64))


@pytest.mark.parametrize("isa", RUNNABLE)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_drafting_windows_wider_than_the_query(isa, dtype):
    """A drafting pass queries a tree's newest layer: its window holds the
    earlier nodes, already cached, seen by their ancestor bits."""
    _check(isa, *_case(3, [90, 400, 31], [2, 6, 1], dtype=dtype, block_size=32, extra_window=9))


@pytest.mark.parametrize("isa", RUNNABLE)
def test_wide_trees_and_many_requests(isa):
    """64 requests of 600 keys and 8 rows, and wide trees of 64 rows."""
    _check(isa, *_case(4, [600] * 64, [8] * 64))
    _check(isa, *_case(5, [900, 150], [64, 64], extra_window=20))


def test_a_strided_query_and_a_cache_view():
    """A query picked out of a pass's rows and one layer's view of a larger cache read through their strides."""
    query, cache, rows = _case(6, [300, 50], [4, 3])
    padded = torch.randn(query.shape[0], query.shape[1] + 2, query.shape[2])
    padded[:, 1:-1] = query
    wider = torch.randn(2, *cache.shape)
    wider[1] = cache
    _check(native.machine_isa(), padded[:, 1:-1], wider[1], rows)


def test_the_setting_picks_the_path(monkeypatch):
    cpu_library.native_library.cache_clear()
    try:
        monkeypatch.setenv(cpu_library.SETTING, "torch")
        assert native.native_op() is None
        cpu_library.native_library.cache_clear()
        monkeypatch.setenv(cpu_library.SETTING, "native")
        assert native.native_op() is not None
        monkeypatch.setenv(cpu_library.SETTING, "fast")
        with pytest.raises(ValueError, match="auto, native or torch"):
            cpu_library.setting()
    finally:
        cpu_library.native_library.cache_clear()


def test_unsupported_shapes_are_refused():
    query, cache, _ = _case(7, [40], [2], head_size=64)
    assert native.supports(query, cache)
    assert not native.supports(query.half(), cache.half())
    assert not native.supports(query, cache.bfloat16())
    assert not native.supports(query[..., :40], torch.zeros(4, 3, 128, 80))


def _without_a_compiler(setting: str, tmp_path) -> subprocess.CompletedProcess:
    """Ask for the op in a fresh process whose compiler is ``false`` and whose
    extension cache is empty."""
    env = {**os.environ, "CXX": "false", "TORCH_EXTENSIONS_DIR": str(tmp_path), cpu_library.SETTING: setting}
    code = "from kernels import tree_attention_cpu as n; print('op:', n.native_op())"
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)


def test_without_a_compiler_the_torch_path_with_one_warning(tmp_path):
    auto = _without_a_compiler("auto", tmp_path)
    assert auto.returncode == 0 and "op: None" in auto.stdout, auto.stderr
    warnings = [line for line in auto.stderr.splitlines() if "native CPU library unavailable" in line]
    assert len(warnings) == 1 and len(auto.stderr.strip().splitlines()) == 1, auto.stderr
    forced = _without_a_compiler("native", tmp_path)
    assert forced.returncode != 0 and "=native, but the native CPU library did not build" in forced.stderr
