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

The Triton kernel runs one program per (query row, query head) and streams the
row's keys in tiles of ``BLOCK_N`` with an online softmax in float32 (base 2,
the scale folded with log2 e). Tiles are not aligned to cache blocks: each key
finds its physical block on its own. The caches are read through their
strides, so strided views are used as they are.
"""

from __future__ import annotations

import math

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
    def _tree_attention_kernel(
        out_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        block_table_ptr,
        query_start_loc_ptr,
        seq_lens_ptr,
        query_mask_ptr,
        window_lens_ptr,
        row_request_ptr,
        scale_log2e,
        stride_ot,
        stride_oh,
        stride_od,
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
        head_dim,
        GROUP: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        kv_head = head // GROUP
        request = tl.load(row_request_ptr + row)
        seq_len = tl.load(seq_lens_ptr + request)
        context = seq_len - tl.load(window_lens_ptr + request)

        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < head_dim
        q = tl.load(q_ptr + row * stride_qt + head * stride_qh + offs_d * stride_qd, mask=d_mask, other=0.0)
        q = q.to(tl.float32) * scale_log2e

        # A finite start keeps exp2(m_i - m_new) defined when a tile is fully masked.
        m_i = tl.full([], -1.0e30, tl.float32)
        l_i = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], tl.float32)
        for start in range(0, seq_len, BLOCK_N):
            offs_n = start + tl.arange(0, BLOCK_N)
            in_seq = offs_n < seq_len
            physical = tl.load(
                block_table_ptr + request * stride_bt_b + (offs_n // BLOCK_SIZE) * stride_bt_i, mask=in_seq, other=0
            ).to(tl.int64)
            offset = offs_n % BLOCK_SIZE
            kv_mask = in_seq[:, None] & d_mask[None, :]
            k = tl.load(
                k_ptr
                + physical[:, None] * stride_kb
                + offset[:, None] * stride_ks
                + kv_head * stride_kh
                + offs_d[None, :] * stride_kd,
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            j = offs_n - context
            in_query = in_seq & (j >= 0)
            tree_bit = tl.load(query_mask_ptr + row * stride_mt + j * stride_mj, mask=in_query, other=0)
            visible = in_seq & ((j < 0) | (tree_bit != 0))
            s = tl.where(visible, tl.sum(q[None, :] * k, axis=1), float("-inf"))

            m_new = tl.maximum(m_i, tl.max(s, axis=0))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new)
            v = tl.load(
                v_ptr
                + physical[:, None] * stride_vb
                + offset[:, None] * stride_vs
                + kv_head * stride_vh
                + offs_d[None, :] * stride_vd,
                mask=kv_mask,
                other=0.0,
            ).to(tl.float32)
            l_i = l_i * alpha + tl.sum(p, axis=0)
            acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
            m_i = m_new

        out = acc / l_i
        tl.store(
            out_ptr + row * stride_ot + head * stride_oh + offs_d * stride_od,
            out.to(out_ptr.dtype.element_ty),
            mask=d_mask,
        )


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
    block_n: int = 64,
) -> torch.Tensor:
    """Launch the kernel on a (T, Hq) grid; ``block_n`` is the key tile (a power of two)."""
    num_rows, num_heads, head_dim = query.shape
    out = torch.empty((num_rows, num_heads, head_dim), dtype=query.dtype, device=query.device)
    if num_rows == 0:
        return out
    num_requests = seq_lens.shape[0]
    row_request = torch.repeat_interleave(
        torch.arange(num_requests, dtype=torch.int32, device=query.device),
        query_start_loc.diff(),
        output_size=num_rows,
    )
    mask = query_mask.view(torch.uint8)
    windows = query_start_loc.diff() if window_lens is None else window_lens
    _tree_attention_kernel[(num_rows, num_heads)](
        out,
        query,
        key_cache,
        value_cache,
        block_table,
        query_start_loc,
        seq_lens,
        mask,
        windows.to(torch.int32),
        row_request,
        scale * math.log2(math.e),
        *out.stride(),
        *query.stride(),
        *key_cache.stride(),
        *value_cache.stride(),
        *block_table.stride(),
        *mask.stride(),
        head_dim,
        GROUP=num_heads // key_cache.shape[2],
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_N=block_n,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out


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
) -> torch.Tensor:
    """``[T, Hq, D]`` output: the Triton kernel on CUDA, the torch reference elsewhere."""
    impl = tree_attention_triton if triton is not None and query.is_cuda else tree_attention_reference
    return impl(query, key_cache, value_cache, block_table, query_start_loc, seq_lens, query_mask, scale, window_lens)
