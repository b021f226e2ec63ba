"""Attention over a paged KV cache with a per-request mask over the query tokens.

Each request ``b`` has ``seq_lens[b]`` keys; its last ``window_b`` keys (by
default ``window_b = q_len_b``, its own query tokens) are *masked* keys, already
written to the cache, and the keys before them are context. Every query row
sees all context keys, and sees the request's masked keys where
``query_mask`` says so: ``query_mask[t, j]`` is the visibility of the ``j``-th
masked key of the row's request. A causal request uses
:func:`causal_query_mask`; a token tree uses ancestor-or-self bits. A window
wider than the query serves tree drafting, where one pass queries only the
newest layer of a tree whose earlier nodes are already cached.

The Triton kernel is built for the GPU (flash-decoding with GQA packing):

* a program owns one request, one KV head and one slice of the request's keys,
  and packs that request's query rows times the group's query heads into the
  M dimension of ``tl.dot`` (``BLOCK_M`` at most 128; longer trees take
  several query tiles, adjacent in the grid so their KV reads meet in L2).
  Each KV tile is loaded once for all of them and both products run on
  tensor cores, with an online softmax in float32 (base 2, the scale folded
  with log2 e); float32 inputs use exact ("ieee") products;
* the keys are split into slices when the batch alone cannot fill the GPU,
  each slice writing its normalised output and log-sum-exp, and a second
  kernel merging the slices;
* whole context tiles run without any mask; only the last tiles of a slice
  (a partial tile and the masked window) read ``query_mask``.

Tiles are not aligned to cache blocks: each key finds its physical block on
its own, so slices may cut a block. The caches are read through their
strides, so strided views are used as they are.
"""

from __future__ import annotations

import functools
import math
import os

import torch

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = None


def causal_query_mask(query_start_loc: torch.Tensor, width: int) -> torch.Tensor:
    """``[T, width]`` bool mask for causal requests: local row ``i`` sees ``j <= i``."""
    num_rows = int(query_start_loc[-1])
    starts = torch.repeat_interleave(
        query_start_loc[:-1].long(), query_start_loc.diff().long(), output_size=num_rows
    )
    local = torch.arange(num_rows, device=query_start_loc.device) - starts
    return torch.arange(width, device=query_start_loc.device)[None, :] <= local[:, None]


def key_visibility(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    query_mask: torch.Tensor,
    span: int,
    window_lens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each query row's ``request`` and ``local`` row, and the ``[B, L, span]``
    bool visibility of key positions: every context key, and the
    ``query_mask`` bits of the request's last ``window`` keys. Padding rows
    see key 0 only, so their (unused) softmax is defined."""
    device = query_start_loc.device
    q_lens = query_start_loc.diff().long()
    num_rows = int(query_start_loc[-1])
    batch, max_q = seq_lens.shape[0], int(q_lens.max())
    request = torch.repeat_interleave(torch.arange(batch, device=device), q_lens, output_size=num_rows)
    local = torch.arange(num_rows, device=device) - query_start_loc[:-1].long()[request]
    windows = (q_lens if window_lens is None else window_lens.long())[request].unsqueeze(1)
    in_query = torch.arange(span, device=device).unsqueeze(0) - (seq_lens.long()[request].unsqueeze(1) - windows)
    width = query_mask.shape[1]
    bits = query_mask.gather(1, in_query.clamp(0, width - 1)) & (in_query >= 0) & (in_query < windows) & (in_query < width)
    visible = torch.zeros(batch, max_q, span, dtype=torch.bool, device=device)
    visible[:, :, 0] = True
    visible[request, local] = (in_query < 0) | bits
    return request, local, visible


def tree_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    query_mask: torch.Tensor,
    scale: float,
    window_lens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Plain torch, the whole batch at once: gather every request's cache
    blocks into a padded ``[B, S, H, D]``, build the ``[B, L, S]`` visibility
    mask, and run one masked ``scaled_dot_product_attention`` in float32."""
    batch = seq_lens.shape[0]
    block_size, num_kv_heads, head_dim = key_cache.shape[1:]
    device = query.device
    max_q, max_s = int(query_start_loc.diff().max()), int(seq_lens.max())
    num_blocks = -(-max_s // block_size)

    blocks = block_table[:, :num_blocks].long()
    keys = key_cache[blocks].reshape(batch, -1, num_kv_heads, head_dim)[:, :max_s]
    values = value_cache[blocks].reshape(batch, -1, num_kv_heads, head_dim)[:, :max_s]

    request, local, visible = key_visibility(query_start_loc, seq_lens, query_mask, max_s, window_lens)

    queries = torch.zeros(batch, max_q, *query.shape[1:], dtype=torch.float32, device=device)
    queries[request, local] = query.float()
    attended = torch.nn.functional.scaled_dot_product_attention(
        queries.transpose(1, 2),
        keys.float().transpose(1, 2),
        values.float().transpose(1, 2),
        attn_mask=visible.unsqueeze(1),
        scale=scale,
        enable_gqa=True,
    )
    return attended.transpose(1, 2)[request, local].to(query.dtype)


if triton is not None:

    @triton.jit
    def _mma(a, b, PRECISION: tl.constexpr, UPCAST: tl.constexpr):
        """``tl.dot``; with ``UPCAST`` in float32, for the interpreter, whose
        product reads bfloat16 operands as raw bits."""
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        return tl.dot(a, b, input_precision=PRECISION)

    @triton.jit
    def _tree_attention_kernel(
        out_ptr,
        lse_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_table_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        window_lens_ptr,
        query_mask_ptr,
        scale_log2e,
        num_kv_heads,
        keys_per_split,
        mask_width,
        head_dim,
        stride_os,
        stride_ot,
        stride_oh,
        stride_ls,
        stride_lt,
        stride_qt,
        stride_qh,
        stride_qd,
        stride_kb,
        stride_ks,
        stride_kh,
        stride_kd,
        stride_vb,
        stride_vs,
        stride_vh,
        stride_vd,
        stride_bt_b,
        stride_bt_i,
        stride_mt,
        stride_mj,
        GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
        SPLIT: tl.constexpr,
        HAS_WINDOW: tl.constexpr,
        DEVICE_SPLITS: tl.constexpr,
        PRECISION: tl.constexpr,
        UPCAST: tl.constexpr,
    ):
        """One program: ``BLOCK_M`` (query row, query head) pairs of one request
        and one KV group, over one slice of the request's keys. With
        ``DEVICE_SPLITS`` the slices cut each request's own keys in equal
        whole tiles (``keys_per_split`` is ignored), so the grid does not
        depend on any length the host would have to read."""
        m_tile = tl.program_id(0)
        request = tl.program_id(1) // num_kv_heads
        kv_head = tl.program_id(1) % num_kv_heads
        split = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + request)
        q_len = tl.load(query_start_loc_ptr + request + 1) - q_start
        if m_tile * BLOCK_M >= q_len * GROUP:
            return
        seq_len = tl.load(seq_lens_ptr + request)
        if DEVICE_SPLITS:
            keys_per_split = tl.cdiv(tl.cdiv(seq_len, BLOCK_N), tl.num_programs(2)) * BLOCK_N
        if HAS_WINDOW:
            context = seq_len - tl.load(window_lens_ptr + request)
        else:
            context = seq_len - q_len
        lo = split * keys_per_split
        hi = tl.minimum(lo + keys_per_split, seq_len)

        offs_m = m_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        local = offs_m // GROUP
        head = kv_head * GROUP + offs_m % GROUP
        row = (q_start + local).to(tl.int64)
        m_valid = local < q_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        q = tl.load(
            q_ptr + row[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :] * stride_qd,
            mask=m_valid[:, None] & d_mask[None, :],
            other=0.0,
        )
        table = block_table_ptr + request.to(tl.int64) * stride_bt_b
        k_head = k_ptr + kv_head * stride_kh + offs_d[None, :] * stride_kd
        v_head = v_ptr + kv_head * stride_vh + offs_d[None, :] * stride_vd

        # A finite start keeps exp2(m_i - m_new) defined while a row has seen no key.
        m_i = tl.full([BLOCK_M], -1.0e30, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

        # Context keys every row sees: whole tiles, no mask.
        prefix_end = lo + tl.maximum(tl.minimum(hi, context) - lo, 0) // BLOCK_N * BLOCK_N
        for start in range(lo, prefix_end, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            slot = tl.load(table + (offs_n // BLOCK_SIZE) * stride_bt_i).to(tl.int64)
            offset = offs_n % BLOCK_SIZE
            k = tl.load(k_head + slot[:, None] * stride_kb + offset[:, None] * stride_ks, mask=d_mask[None, :], other=0.0)
            s = _mma(q, tl.trans(k), PRECISION, UPCAST) * scale_log2e
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + slot[:, None] * stride_vb + offset[:, None] * stride_vs, mask=d_mask[None, :], other=0.0)
            acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, PRECISION, UPCAST)
            m_i = m_new

        # The rest of the slice: a partial context tile and the masked window.
        for start in range(prefix_end, hi, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_slice = offs_n < hi
            slot = tl.load(table + (offs_n // BLOCK_SIZE) * stride_bt_i, mask=in_slice, other=0).to(tl.int64)
            offset = offs_n % BLOCK_SIZE
            kv_mask = in_slice[:, None] & d_mask[None, :]
            k = tl.load(k_head + slot[:, None] * stride_kb + offset[:, None] * stride_ks, mask=kv_mask, other=0.0)
            s = _mma(q, tl.trans(k), PRECISION, UPCAST) * scale_log2e
            j = offs_n - context
            in_window = in_slice & (j >= 0) & (j < mask_width)
            bits = tl.load(
                query_mask_ptr + row[:, None] * stride_mt + j[None, :] * stride_mj,
                mask=m_valid[:, None] & in_window[None, :],
                other=0,
            )
            visible = (in_slice & (j < 0))[None, :] | (bits != 0)
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, axis=1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(v_head + slot[:, None] * stride_vb + offset[:, None] * stride_vs, mask=kv_mask, other=0.0)
            acc = acc * alpha[:, None] + _mma(p.to(v.dtype), v, PRECISION, UPCAST)
            m_i = m_new

        seen = l_i > 0
        out = acc / tl.where(seen, l_i, 1.0)[:, None]
        out_rows = out_ptr + split * stride_os + row[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :]
        tl.store(out_rows, out.to(out_ptr.dtype.element_ty), mask=m_valid[:, None] & d_mask[None, :])
        if SPLIT:
            lse = tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf"))
            tl.store(lse_ptr + split * stride_ls + row * stride_lt + head, lse, mask=m_valid)

    @triton.jit
    def _merge_splits_kernel(
        out_ptr,
        part_ptr,
        lse_ptr,
        num_splits,
        head_dim,
        stride_ot,
        stride_oh,
        stride_ps,
        stride_pt,
        stride_ph,
        stride_ls,
        stride_lt,
        BLOCK_S: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (query row, query head): the log-sum-exp weighted
        sum of its slices' normalised outputs."""
        row = tl.program_id(0).to(tl.int64)
        head = tl.program_id(1)
        offs_s = tl.arange(0, BLOCK_S)
        offs_d = tl.arange(0, BLOCK_D)
        s_mask = offs_s < num_splits
        lse = tl.load(lse_ptr + offs_s * stride_ls + row * stride_lt + head, mask=s_mask, other=float("-inf"))
        # An empty slice (past a short request's keys) has lse -inf and weight 0.
        weight = tl.where(lse > float("-inf"), tl.exp2(lse - tl.max(lse, axis=0)), 0.0)
        part = tl.load(
            part_ptr + offs_s[:, None] * stride_ps + row * stride_pt + head * stride_ph + offs_d[None, :],
            mask=s_mask[:, None] & (offs_d < head_dim)[None, :],
            other=0.0,
        )
        out = tl.sum(weight[:, None] * part, axis=0) / tl.sum(weight, axis=0)
        tl.store(out_ptr + row * stride_ot + head * stride_oh + offs_d, out.to(out_ptr.dtype.element_ty), mask=offs_d < head_dim)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def _split_plan(max_seq_len: int, programs: int, block_n: int, device: torch.device) -> tuple[int, int]:
    """(number of slices, keys per slice): enough programs to give every
    multiprocessor one when the batch alone does not, each slice at least four
    tiles and a whole number of them (flash-decoding). Measured on an H100:
    slicing past one program per multiprocessor only adds the merge."""
    tiles = -(-max_seq_len // block_n)
    splits = max(1, min(-(-_multiprocessors(device) // programs), tiles // 4))
    keys_per_split = -(-tiles // splits) * block_n
    return -(-max_seq_len // keys_per_split), keys_per_split


def graph_splits(num_requests: int, rows: int, num_heads: int, num_kv_heads: int, device: torch.device,
                 most: int = 16) -> int:
    """The slice count of a graph-safe launch (``splits_on_device``): enough
    programs for every multiprocessor when the batch alone has too few, at
    most ``most``; a function of the shapes only, so a graph's capture and
    its replays agree."""
    packed = rows * (num_heads // num_kv_heads)
    programs = -(-packed // _launch_choice(packed)["block_m"]) * num_requests * num_kv_heads
    return max(1, min(most, -(-_multiprocessors(device) // programs)))


def _launch_choice(packed: int) -> dict:
    """Tiles, warps and pipeline depth by the packed query rows, from the
    H100 sweep of ``benchmarks/kernel_bench.py --tune``: query tiles of 128 need
    8 warps and key tiles of 128 (4 warps spill and run 2.6 times slower)."""
    if packed >= 128:
        return dict(block_m=128, block_n=128, num_warps=8, num_stages=3)
    return dict(block_m=max(16, triton.next_power_of_2(packed)), block_n=64, num_warps=4, num_stages=2)


def tree_attention_triton(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    query_mask: torch.Tensor,
    scale: float,
    window_lens: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
    num_splits: int | None = None,
    splits_on_device: bool = False,
    **launch: int,
) -> torch.Tensor:
    """Launch the kernel on a (query tiles, requests x KV heads, slices) grid,
    then merge the slices when there are several.

    ``max_query_len`` and ``max_seq_len`` are read off the device when not
    given (an attention backend has them on the host). ``num_splits`` and
    ``launch`` (``block_m``: packed (row, head) pairs per program, ``block_n``:
    the key tile, ``num_warps``, ``num_stages``) override the heuristic, for
    the tests and the benchmark's sweep.

    ``splits_on_device``: the launch a CUDA graph can replay: the
    grid is fixed by ``max_query_len`` (the step's rows a request),
    ``num_splits`` and the batch; each request's slices are cut in the kernel
    from its own length; ``max_seq_len`` is neither read nor needed.
    """
    num_rows, num_heads, head_dim = query.shape
    out = torch.empty((num_rows, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_rows == 0:
        return out
    num_requests, num_kv_heads = seq_lens.shape[0], key_cache.shape[2]
    group = num_heads // num_kv_heads
    if max_query_len is None:
        max_query_len = int(query_start_loc.diff().max())
    if splits_on_device and (num_splits is None or max_seq_len is not None):
        raise ValueError("splits_on_device takes num_splits and no max_seq_len")
    if max_seq_len is None and not splits_on_device:
        max_seq_len = int(seq_lens.max())
    packed = max_query_len * group
    launch = _launch_choice(packed) | launch
    block_m, block_n = launch["block_m"], launch["block_n"]
    m_tiles = -(-packed // block_m)
    if splits_on_device:
        keys_per_split = 0  # cut per request in the kernel
    else:
        num_splits, keys_per_split = _splits(max_seq_len, num_splits, m_tiles * num_requests * num_kv_heads, block_n,
                                             query.device)
    mask = query_mask.view(torch.uint8)
    upcast = query.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    if num_splits > 1:
        partial = torch.empty((num_splits, num_rows, num_heads, head_dim), dtype=torch.float32, device=query.device)
        lse = torch.empty((num_splits, num_rows, num_heads), dtype=torch.float32, device=query.device)
        target, lse_strides = partial, lse.stride()[:2]
    else:
        target, lse, lse_strides = out.unsqueeze(0), out, (0, 0)
    _tree_attention_kernel[(m_tiles, num_requests * num_kv_heads, num_splits)](
        target,
        lse,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        seq_lens if window_lens is None else window_lens,
        mask,
        scale * math.log2(math.e),
        num_kv_heads,
        keys_per_split,
        mask.shape[1],
        head_dim,
        *target.stride()[:3],
        *lse_strides,
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_table.stride(),
        *mask.stride(),
        GROUP=group,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        SPLIT=num_splits > 1,
        HAS_WINDOW=window_lens is not None,
        DEVICE_SPLITS=splits_on_device,
        PRECISION="ieee" if query.dtype == torch.float32 or upcast else "tf32",
        UPCAST=upcast,
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
    )
    if num_splits > 1:
        _merge_splits(out, partial, lse)
    return out


def _splits(max_seq_len: int, num_splits: int | None, programs: int, block_n: int, device) -> tuple[int, int]:
    """The key slices of a launch cut on the host: their number and the keys
    each takes (a multiple of the key tile), the heuristic's unless
    ``num_splits`` is given."""
    if num_splits is None:
        return _split_plan(max_seq_len, programs, block_n, device)
    keys_per_split = -(-max_seq_len // (num_splits * block_n)) * block_n
    return -(-max_seq_len // keys_per_split), keys_per_split


def _merge_splits(out: torch.Tensor, partial: torch.Tensor, lse: torch.Tensor) -> None:
    """``out`` from the slices' partial outputs and log-sum-exps."""
    num_splits, num_rows, num_heads, head_dim = partial.shape
    _merge_splits_kernel[(num_rows, num_heads)](
        out,
        partial,
        lse,
        num_splits,
        head_dim,
        *out.stride()[:2],
        *partial.stride()[:3],
        *lse.stride()[:2],
        BLOCK_S=triton.next_power_of_2(num_splits),
        BLOCK_D=triton.next_power_of_2(head_dim),
    )


def tree_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    query_mask: torch.Tensor,
    scale: float,
    window_lens: torch.Tensor | None = None,
    *,
    max_query_len: int | None = None,
    max_seq_len: int | None = None,
) -> torch.Tensor:
    """``[T, Hq, D]`` output: the Triton kernel on CUDA, the torch reference
    elsewhere. ``max_query_len`` / ``max_seq_len``: host-side bounds the
    kernel would otherwise read off the device (a synchronisation)."""
    args = (query, key_cache, value_cache, block_table, query_start_loc, seq_lens, query_mask, scale, window_lens)
    if triton is not None and query.is_cuda:
        return tree_attention_triton(*args, max_query_len=max_query_len, max_seq_len=max_seq_len)
    return tree_attention_reference(*args)
