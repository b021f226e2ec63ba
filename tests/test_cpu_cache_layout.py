"""The CPU tree path reads vLLM's paged KV cache in the layout vLLM's own C++
writer uses (the pinned ``vec`` layout), and compacts it in place."""

from __future__ import annotations

import pytest
import torch

from kernels.kv_compaction import compact_kv


@pytest.fixture(scope="module")
def cpu_ops():
    from vllm import _custom_ops as ops

    return ops


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cache_views_read_what_the_cpp_writer_wrote(cpu_ops, dtype):
    from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views

    torch.manual_seed(0)
    num_blocks, heads, block_size, head_dim = 5, 3, 32, 64
    kv_cache = torch.zeros(num_blocks, heads, block_size, 2 * head_dim, dtype=dtype)
    slots = torch.randperm(num_blocks * block_size)[:70]
    key = torch.randn(len(slots), heads, head_dim).to(dtype)
    value = torch.randn(len(slots), heads, head_dim).to(dtype)
    # The C++ writer takes the same [blocks, heads, 2 * block_size, D] split the backend uses.
    key_area, value_area = kv_cache.view(num_blocks, heads, 2 * block_size, head_dim).chunk(2, dim=2)
    cpu_ops.cpu_attn_reshape_and_cache(key, value, key_area, value_area, slots, "vec")

    key_view, value_view = cache_views(kv_cache)
    blocks, offsets = slots // block_size, slots % block_size
    assert torch.equal(key_view[blocks, offsets], key)
    assert torch.equal(value_view[blocks, offsets], value)
    # The naive row-major reading of the K area is wrong: the layout really is pinned.
    assert not torch.equal(key_area[blocks, :, offsets], key)


def test_compaction_through_the_views_moves_whole_tokens(cpu_ops):
    from vllm_adaptive_spec.adapter.cpu_cache_layout import cache_views

    torch.manual_seed(1)
    num_blocks, heads, block_size, head_dim = 3, 2, 32, 64
    kv_cache = torch.randn(num_blocks, heads, block_size, 2 * head_dim)
    key_view, value_view = cache_views(kv_cache)
    before_k, before_v = key_view.clone(), value_view.clone()
    # Root at slot 30; accepted nodes 2 and 5 (slots 33, 36) move to slots 31, 32.
    src = torch.tensor([[33, 36]])
    dst = torch.tensor([[31, 32]])
    compact_kv([key_view], [value_view], src, dst)
    flat_k, flat_v = key_view.reshape(-1, heads, head_dim), value_view.reshape(-1, heads, head_dim)
    old_k, old_v = before_k.reshape(-1, heads, head_dim), before_v.reshape(-1, heads, head_dim)
    assert torch.equal(flat_k[31], old_k[33]) and torch.equal(flat_v[32], old_v[36])
    untouched = [s for s in range(num_blocks * block_size) if s not in (31, 32)]
    assert torch.equal(flat_k[untouched], old_k[untouched])
    assert torch.equal(flat_v[untouched], old_v[untouched])
