"""The CUDA backends' tree path, on a GPU where there is one, else on CPU tensors.

vLLM's Python source is the same in its CPU and CUDA builds, so the plugin's
``FLASH_ATTN`` and ``TRITON_ATTN`` impls are built here as on a GPU. Each
layer's cache is written by the backend's own ``do_kv_cache_update`` (on a
GPU with vLLM's own writer; on a CPU with the writer's documented contract,
since vLLM's CUDA op and Triton kernel do not run there), in both physical
stride orders vLLM may allocate, then the rows of a branching tree go through
the impl's ``forward``: with the torch reference, and with the project's
Triton kernel (under the interpreter on a CPU). Both must equal the reference
computed from the raw keys and values, which pins the layout the tree path
reads to the one each backend writes.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.attention.backend import AttentionType
from vllm.v1.attention.backends import flash_attn, triton_attn

from kernels.tree_attention import tree_attention_reference, tree_attention_triton
from vllm_adaptive_spec.adapter import attention_cuda
from vllm_adaptive_spec.adapter.attention_cuda import TreeFlashAttentionImpl, TreeTritonAttentionImpl, cache_views
from vllm_adaptive_spec.adapter.cudagraphs import graph_modes
from vllm_adaptive_spec.adapter.tree_impl import check_tree_backends
from vllm_adaptive_spec.step import tree_step

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 4, 2, 16, 16
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# The tree path's kernel, as ``kernels.tree_attention``'s dispatch is called (the reference takes no host bounds).
KERNELS = {"reference": lambda *args, max_query_len=None, max_seq_len=None: tree_attention_reference(*args),
           "triton": tree_attention_triton}
WRITERS = {
    TreeFlashAttentionImpl: (flash_attn, "reshape_and_cache_flash"),
    TreeTritonAttentionImpl: (triton_attn, "triton_reshape_and_cache_flash"),
}


def write_by_contract(key, value, key_cache, value_cache, slot_mapping, *args):
    """``reshape_and_cache_flash``'s contract (both backends' writers): token
    ``t`` goes to (block ``slot // block_size``, offset ``slot % block_size``)
    of ``[num_blocks, block_size, H, D]`` caches."""
    block_size = key_cache.shape[1]
    blocks, offsets = slot_mapping // block_size, slot_mapping % block_size
    key_cache[blocks, offsets] = key[: slot_mapping.shape[0]]
    value_cache[blocks, offsets] = value[: slot_mapping.shape[0]]


def layer_cache(num_blocks: int, order: str, dtype: torch.dtype) -> torch.Tensor:
    """A layer's logical ``[num_blocks, H, block_size, 2 * D]`` cache of noise,
    token-major in memory (``LBNHC``, vLLM's default for these backends) or
    head-major (``LBHNC``)."""
    noise = torch.Generator().manual_seed(1)
    if order == "LBNHC":
        return torch.randn(num_blocks, BLOCK, KV_HEADS, 2 * HEAD_DIM, generator=noise).to(dtype).permute(0, 2, 1, 3)
    return torch.randn(num_blocks, KV_HEADS, BLOCK, 2 * HEAD_DIM, generator=noise).to(dtype)


def tree_mask(gen: torch.Generator, size: int) -> torch.Tensor:
    """Ancestor-or-self mask of a random breadth-first tree (row 0: the root)."""
    mask = torch.eye(size, dtype=torch.bool)
    for node in range(1, size):
        parent = int(torch.randint(0, node, (1,), generator=gen))
        mask[node] |= mask[parent]
    return mask


def paged_keys(gen: torch.Generator, seq_lens: list[int], table_rows: int, dtype: torch.dtype):
    """Blocks handed out shuffled to requests of ``seq_lens`` keys (a block
    table of ``table_rows`` rows, the rest empty), each key's slot, and random
    keys and values: ``(num_blocks, block_table, slots, keys, values)``."""
    per_request = [-(-s // BLOCK) for s in seq_lens]
    num_blocks = sum(per_request) + 2
    physical = torch.randperm(num_blocks, generator=gen)
    block_table = torch.zeros(table_rows, max(per_request), dtype=torch.int32)
    used = 0
    for b, n in enumerate(per_request):
        block_table[b, :n] = physical[used:used + n].int()
        used += n
    slots = torch.cat([
        block_table[b, torch.arange(s) // BLOCK].long() * BLOCK + torch.arange(s) % BLOCK for b, s in enumerate(seq_lens)
    ])
    total = int(sum(seq_lens))
    keys = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    values = torch.randn(total, KV_HEADS, HEAD_DIM, generator=gen).to(dtype)
    return num_blocks, block_table, slots, keys, values


def make_case(dtype: torch.dtype, seed: int = 0):
    """Three requests (contexts 5, 20 and 40 keys; trees of 4, 7 and 2 rows),
    blocks handed out shuffled."""
    gen = torch.Generator().manual_seed(seed)
    contexts, sizes = [5, 20, 40], [4, 7, 2]
    seq_lens = [c + s for c, s in zip(contexts, sizes)]
    num_blocks, block_table, slots, keys, values = paged_keys(gen, seq_lens, 3, dtype)
    query = torch.randn(int(sum(sizes)), HEADS, HEAD_DIM, generator=gen).to(dtype)
    width = max(sizes)
    masks = [torch.nn.functional.pad(tree_mask(gen, s), (0, width - s), value=True) for s in sizes]
    rows = tree_step.DraftStep(
        batch_indices=torch.arange(3),
        query_rows=torch.arange(query.shape[0]),
        query_start_loc=torch.tensor([0, *torch.tensor(sizes).cumsum(0).tolist()], dtype=torch.int32),
        query_mask=torch.cat(masks),
        window_lens=torch.tensor(sizes, dtype=torch.int32),
        max_query_len=width,
    )
    metadata = SimpleNamespace(
        num_actual_tokens=query.shape[0], block_table=block_table,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32), max_seq_len=max(seq_lens),
    )
    # The reference reads caches written directly, without vLLM's views.
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    key_cache[slots // BLOCK, slots % BLOCK] = keys
    value_cache[slots // BLOCK, slots % BLOCK] = values
    expected = tree_attention_reference(
        query, key_cache, value_cache, block_table, rows.query_start_loc, metadata.seq_lens, rows.query_mask,
        HEAD_DIM**-0.5, rows.window_lens,
    )
    rows = tree_step.DraftStep(**{k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in vars(rows).items()})
    metadata = SimpleNamespace(**{k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in vars(metadata).items()})
    return SimpleNamespace(num_blocks=num_blocks, slots=slots.to(DEVICE), keys=keys.to(DEVICE),
                           values=values.to(DEVICE), query=query.to(DEVICE), rows=rows, metadata=metadata,
                           expected=expected.to(DEVICE))


def make_impl(cls, **overrides):
    args = dict(num_heads=HEADS, head_size=HEAD_DIM, scale=HEAD_DIM**-0.5, num_kv_heads=KV_HEADS, alibi_slopes=None,
                sliding_window=None, kv_cache_dtype="auto", logits_soft_cap=None, attn_type=AttentionType.DECODER,
                kv_sharing_target_layer_name=None) | overrides
    return cls(*args.values())


@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", [TreeFlashAttentionImpl, TreeTritonAttentionImpl], ids=["FLASH_ATTN", "TRITON_ATTN"])
def test_tree_rows_read_the_cache_the_backend_wrote(monkeypatch, cls, dtype, order, kernel):
    case = make_case(dtype)
    if DEVICE == "cpu":
        module, writer = WRITERS[cls]
        monkeypatch.setattr(module, writer, write_by_contract, raising=False)  # the CPU build imports no CUDA writer
    monkeypatch.setattr(attention_cuda, "tree_attention", KERNELS[kernel])
    impl = make_impl(cls)
    layer = SimpleNamespace(_k_scale=torch.ones((), device=DEVICE), _v_scale=torch.ones((), device=DEVICE))
    kv_cache = layer_cache(case.num_blocks, order, dtype).to(DEVICE)
    impl.do_kv_cache_update(layer, case.keys, case.values, kv_cache, case.slots)

    key_view, value_view = cache_views(kv_cache)
    assert key_view.shape == (case.num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    assert torch.equal(key_view[case.slots // BLOCK, case.slots % BLOCK], case.keys)
    assert torch.equal(value_view[case.slots // BLOCK, case.slots % BLOCK], case.values)

    output = torch.zeros(case.query.shape[0], HEADS * HEAD_DIM, dtype=dtype, device=DEVICE)
    with tree_step.published(case.rows):
        impl.forward(layer, case.query, None, None, kv_cache, case.metadata, output)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.view_as(case.query).float(), case.expected.float(), atol=tolerance, rtol=tolerance)


def test_the_test_sees_a_wrong_layout(monkeypatch):
    """Reading K where V is (a layout the backends do not write) fails the check above."""
    case = make_case(torch.float32)
    monkeypatch.setattr(triton_attn, "triton_reshape_and_cache_flash", write_by_contract)
    monkeypatch.setattr(attention_cuda, "cache_views", lambda kv: tuple(reversed(cache_views(kv))))
    impl = make_impl(TreeTritonAttentionImpl)
    layer = SimpleNamespace(_k_scale=torch.ones((), device=DEVICE), _v_scale=torch.ones((), device=DEVICE))
    kv_cache = layer_cache(case.num_blocks, "LBNHC", torch.float32).to(DEVICE)
    impl.do_kv_cache_update(layer, case.keys, case.values, kv_cache, case.slots)
    output = torch.zeros(case.query.shape[0], HEADS * HEAD_DIM, device=DEVICE)
    with tree_step.published(case.rows):
        impl.forward(layer, case.query, None, None, kv_cache, case.metadata, output)
    assert not torch.allclose(output.view_as(case.query), case.expected, atol=1e-2)


@pytest.mark.parametrize("setting,message", [
    (dict(sliding_window=64), "sliding window"),
    (dict(logits_soft_cap=30.0), "logits soft-cap"),
    (dict(kv_cache_dtype="fp8"), "quantized KV cache"),
])
def test_unsupported_attention_features_are_refused(setting, message):
    with pytest.raises(ValueError, match=f"does not support {message}"):
        make_impl(TreeTritonAttentionImpl, **setting)


def test_a_layer_of_another_backend_is_refused():
    class Other:
        pass

    backend = SimpleNamespace(get_name=lambda: "FLASHINFER")
    tree_layer = SimpleNamespace(impl=make_impl(TreeTritonAttentionImpl))
    config = SimpleNamespace(compilation_config=SimpleNamespace(static_forward_context={
        "model.layers.0.attn": tree_layer,
        "model.layers.1.attn": SimpleNamespace(impl=Other(), attn_backend=backend),
    }))
    with pytest.raises(ValueError, match="FLASHINFER, which have no tree path; supported here: FLASH_ATTN, TRITON_ATTN"):
        check_tree_backends(config, ("FLASH_ATTN", "TRITON_ATTN"))
    del config.compilation_config.static_forward_context["model.layers.1.attn"]
    check_tree_backends(config, ("FLASH_ATTN", "TRITON_ATTN"))


def test_a_branching_step_replays_no_full_graph():
    from vllm.config import CUDAGraphMode as Mode

    assert graph_modes(None, None, branching=False) == (None, None)
    assert graph_modes(None, None, branching=True) == (None, {Mode.FULL})
    assert graph_modes({Mode.NONE}, None, branching=True) == ({Mode.NONE}, {Mode.FULL})
    # Only FULL allowed (a data-parallel peer's mode): the step runs eagerly.
    assert graph_modes({Mode.FULL}, None, branching=True) == ({Mode.NONE}, {Mode.FULL})


def make_uniform_case(dtype: torch.dtype, rows: int = 6, seed: int = 3):
    """A uniform tree step of three requests, ``rows`` rows each (contexts 5,
    20 and 40 keys; trees of 6, 3 and 1 nodes, the rest padding rows that see
    up to the root), and one padding request of no rows and no keys, as a
    FULL graph pads a batch; the masks sit in a persistent buffer wider and
    longer than the step."""
    gen = torch.Generator().manual_seed(seed)
    contexts, nodes = [5, 20, 40], [rows - 1, 3, 1]
    seq_lens = [c + rows for c in contexts]
    num_blocks, block_table, slots, keys, values = paged_keys(gen, seq_lens, 4, dtype)
    query = torch.randn(3 * rows, HEADS, HEAD_DIM, generator=gen).to(dtype)
    masks = []
    for n in nodes:
        mask = torch.zeros(rows, rows, dtype=torch.bool)
        mask[: n + 1, : n + 1] = tree_mask(gen, n + 1)
        mask[n + 1:, 0] = True  # padding rows: the root only
        masks.append(mask)
    buffer = torch.ones(64, rows + 3, dtype=torch.bool)  # stale contents beyond the step
    buffer[: 3 * rows, :rows] = torch.cat(masks)
    query_start_loc = torch.tensor([0, rows, 2 * rows, 3 * rows, 3 * rows], dtype=torch.int32)
    metadata = SimpleNamespace(num_actual_tokens=3 * rows, block_table=block_table, query_start_loc=query_start_loc,
                               seq_lens=torch.tensor([*seq_lens, 0], dtype=torch.int32), max_seq_len=max(seq_lens))
    key_cache = torch.zeros(num_blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype)
    value_cache = torch.zeros_like(key_cache)
    key_cache[slots // BLOCK, slots % BLOCK] = keys
    value_cache[slots // BLOCK, slots % BLOCK] = values
    expected = tree_attention_reference(query, key_cache, value_cache, block_table[:3], query_start_loc[:4],
                                        metadata.seq_lens[:3], torch.cat(masks), HEAD_DIM**-0.5)
    metadata = SimpleNamespace(**{k: v.to(DEVICE) if torch.is_tensor(v) else v for k, v in vars(metadata).items()})
    return SimpleNamespace(num_blocks=num_blocks, slots=slots.to(DEVICE), keys=keys.to(DEVICE),
                           values=values.to(DEVICE), query=query.to(DEVICE), metadata=metadata,
                           rows=tree_step.UniformRows(buffer.to(DEVICE), rows), expected=expected.to(DEVICE))


@pytest.mark.parametrize("order", ["LBNHC", "LBHNC"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", [TreeFlashAttentionImpl, TreeTritonAttentionImpl], ids=["FLASH_ATTN", "TRITON_ATTN"])
def test_a_uniform_step_takes_the_graph_safe_launch_over_every_row(monkeypatch, cls, dtype, order):
    """In a uniform tree step (what a FULL graph replays) every row
    goes through the tree kernel's graph-safe launch, reading vLLM's own
    metadata and the persistent mask buffer; the stock kernel does not run."""
    case = make_uniform_case(dtype)
    if DEVICE == "cpu":
        module, writer = WRITERS[cls]
        monkeypatch.setattr(module, writer, write_by_contract, raising=False)
    impl = make_impl(cls)
    stock = next(c for c in cls.__mro__ if c.__module__.startswith("vllm.v1"))
    monkeypatch.setattr(stock, "forward", lambda *args, **kwargs: pytest.fail("the stock kernel ran"))
    layer = SimpleNamespace(_k_scale=torch.ones((), device=DEVICE), _v_scale=torch.ones((), device=DEVICE))
    kv_cache = layer_cache(case.num_blocks, order, dtype).to(DEVICE)
    impl.do_kv_cache_update(layer, case.keys, case.values, kv_cache, case.slots)
    output = torch.zeros(case.query.shape[0], HEADS * HEAD_DIM, dtype=dtype, device=DEVICE)
    with tree_step.published(case.rows):
        impl.forward(layer, case.query, None, None, kv_cache, case.metadata, output)
    tolerance = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(output.view_as(case.query).float(), case.expected.float(), atol=tolerance, rtol=tolerance)
