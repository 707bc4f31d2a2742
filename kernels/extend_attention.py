"""Extend (prefill) attention: each request's new tokens attend to its cached prefix and,
causally, to each other, flash-attention style (online softmax over key tiles).

New tokens of request b sit at rows extend_starts[b] .. extend_starts[b] + extend_lens[b] of
q; new token i is at position prefix_lens[b] + i and sees positions 0 .. prefix_lens[b] + i.
Every key, prefix and new alike, is read through the slot table
`req_to_token[req_rows[b], :prefix + extend]`: the new tokens' K/V must already be in the
pool (store_kv runs first). One path for both keeps the kernel simple; the new tokens are
the few rows of a long context that would be cheaper to read from k/v directly.

Grid: (bs, num_heads, cdiv(max_extend_len, BLOCK_M)); a program takes BLOCK_M new tokens of
one request and one head (KV head = head // group), and returns at once past its request's
new tokens. It walks the prefix and the new tokens every query of the block sees without a
causal mask, then the diagonal tiles with one. Under a causal mask the last blocks of a
request have the most keys, so the grid's third axis runs backwards (HEAVY_FIRST): the GPU
dispatches blocks in grid order, and the longest ones starting last would leave a tail of
a few busy SMs.

A sliding window (`window`: the query at position t sees keys at positions > t - window)
starts the walk at the first tile the block's first query sees and masks every tile; a
softcap maps each score s to cap * tanh(s / cap). Both are constexpr-gated: a call without
them compiles to the plain kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    INDEX_DTYPES,
    check_attention_inputs,
    check_launch,
    check_tensor,
    check_tile,
    check_window_softcap,
    dot_precision,
    next_pow2,
)
from kernels._math import tanh
from kernels.fp8_kv import gather_kv


@triton.jit
def _attend_tile(
    acc,
    l_i,
    m_i,
    q,
    q_pos,
    n0,
    limit,
    k_buf_ptr,
    v_buf_ptr,
    table_row_ptr,
    kv_head,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    offs_d,
    d_mask,
    qk_scale,
    window,
    softcap,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys n0 .. n0 + BLOCK_N (those < limit); scores in
    base 2 (qk_scale includes log2(e), or with a softcap, the cap does)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_mask = offs_n < limit
    slots = tl.load(table_row_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
    k_offs = slots[None, :] * stride_kt + kv_head * stride_kh + offs_d[:, None]
    k = tl.load(k_buf_ptr + k_offs, mask=d_mask[:, None] & n_mask[None, :], other=0.0)
    qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * qk_scale
    if USE_SOFTCAP:
        qk = tanh(qk / softcap) * (softcap * 1.4426950408889634)
    mask = n_mask[None, :]
    if CAUSAL:
        mask = mask & (offs_n[None, :] <= q_pos[:, None])
    if USE_WINDOW:
        mask = mask & (offs_n[None, :] > q_pos[:, None] - window)
    qk = tl.where(mask, qk, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(qk, 1))
    # Without a window every row (padding rows too) sees key 0 in the first tile, so m_new
    # is finite; with one, a row may have seen no key yet: its sums must stay zero, not NaN.
    m_shift = tl.where(m_new == float("-inf"), 0.0, m_new) if USE_WINDOW else m_new
    alpha = tl.exp2(m_i - m_shift)
    p = tl.exp2(qk - m_shift[:, None])
    v_offs = slots[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :]
    v = tl.load(v_buf_ptr + v_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
    pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
    return acc * alpha[:, None] + pv, l_i * alpha + tl.sum(p, 1), m_new


@triton.jit
def _extend_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    out_ptr,
    req_to_token_ptr,
    req_rows_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    extend_starts_ptr,
    sm_scale,
    window,
    softcap,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_outt,
    stride_outh,
    stride_rt,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAVY_FIRST: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    if HEAVY_FIRST:
        m_start = (tl.num_programs(2) - 1 - tl.program_id(2)) * BLOCK_M
    else:
        m_start = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if m_start < extend_len:
        kv_head = head // GROUP
        prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
        first_tok = tl.load(extend_starts_ptr + b).to(tl.int64)
        table_row_ptr = req_to_token_ptr + tl.load(req_rows_ptr + b).to(tl.int64) * stride_rt
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < extend_len
        offs_d = tl.arange(0, BLOCK_D)
        d_mask = offs_d < HEAD_DIM
        tok = first_tok + offs_m
        q_offs = tok[:, None] * stride_qt + head * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=m_mask[:, None] & d_mask[None, :], other=0.0)
        q_pos = prefix + offs_m  # each query's position; it sees keys at positions <= q_pos
        # log2(e): exp2 is the native instruction; a softcap applies it after the cap.
        qk_scale = sm_scale if USE_SOFTCAP else sm_scale * 1.4426950408889634
        if USE_WINDOW:
            # Tiles wholly before the first query's window are skipped; tile starts stay on
            # the grid of the unwindowed walk.
            lo = tl.maximum(prefix + m_start - window + 1, 0)
            prefix_lo = lo // BLOCK_N * BLOCK_N
            new_lo = prefix + tl.maximum(lo - prefix, 0) // BLOCK_N * BLOCK_N
        else:
            prefix_lo = 0
            new_lo = prefix

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # The cached prefix: every query sees all of it, no causal mask.
        for n0 in range(prefix_lo, prefix, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, n0, prefix, k_buf_ptr, v_buf_ptr, table_row_ptr,
                kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale,
                window, softcap, False, BLOCK_N, DOT_PRECISION, USE_WINDOW, USE_SOFTCAP,
            )  # fmt: skip
        # New tokens before the block's first query: every query sees whole tiles of them.
        seen_by_all = prefix + (m_start // BLOCK_N) * BLOCK_N
        for n0 in range(new_lo, seen_by_all, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, n0, seen_by_all, k_buf_ptr, v_buf_ptr, table_row_ptr,
                kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale,
                window, softcap, False, BLOCK_N, DOT_PRECISION, USE_WINDOW, USE_SOFTCAP,
            )  # fmt: skip
        # The diagonal, causally; new tokens past the block's last query are invisible to it.
        end = prefix + tl.minimum(extend_len, m_start + BLOCK_M)
        for n0 in range(seen_by_all, end, BLOCK_N):
            acc, l_i, m_i = _attend_tile(
                acc, l_i, m_i, q, q_pos, n0, end, k_buf_ptr, v_buf_ptr, table_row_ptr,
                kv_head, stride_kt, stride_kh, stride_vt, stride_vh, offs_d, d_mask, qk_scale,
                window, softcap, True, BLOCK_N, DOT_PRECISION, USE_WINDOW, USE_SOFTCAP,
            )  # fmt: skip

        out_offs = tok[:, None] * stride_outt + head * stride_outh + offs_d[None, :]
        tl.store(
            out_ptr + out_offs,
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & d_mask[None, :],
        )


def check_extend_tables(
    op: str,
    dev: torch.device,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
) -> int:
    """An extend's per-request tables (req_rows, prefix_lens, extend_lens, extend_starts:
    [bs] ints on `dev`); their bs. The MLA extend (kernels/mla_extend.py) shares them."""
    check_tensor(op, "req_rows", tables[0], shape=(None,), dims="[bs]", dtypes=INDEX_DTYPES)
    bs = tables[0].shape[0]
    names = ("req_rows", "prefix_lens", "extend_lens", "extend_starts")
    for name, t in zip(names, tables, strict=True):
        check_tensor(op, name, t, shape=(bs,), dims="[bs]", dtypes=INDEX_DTYPES, device=dev)
    return bs


def extend_attention(
    *,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    max_extend_len: int,
    sm_scale: float,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    heavy_first: bool = True,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of the new tokens over prefix + new tokens; returns `out`.

    q: [num_tokens, num_heads, head_dim] (any token/head strides); out (optional, written):
    the same shape, q's dtype. k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim], the
    new tokens' K/V already stored. req_to_token: [max_reqs, max_context].
    req_rows, prefix_lens, extend_lens, extend_starts: [bs] ints; extend_starts[b] is the
    first row of request b in q. max_extend_len >= every extend_lens[b] (it sizes the grid;
    not checked, as that would sync). block_m, block_n: powers of two >= 16; num_warps,
    num_stages: the launch configuration (defaults per dtype and head dim); heavy_first: the
    grid order (see the module docstring). window (optional, >= 1): the query at position t
    sees keys at positions > t - window only; softcap (optional, > 0): scores s become
    softcap * tanh(s / softcap).
    """
    op = "extend_attention"
    check_window_softcap(op, window, softcap)
    num_heads, head_dim, num_kv_heads = check_attention_inputs(
        op, q, k_buffer, v_buffer, req_to_token, "[n, heads, d]"
    )
    dev = q.device
    bs = check_extend_tables(op, dev, (req_rows, prefix_lens, extend_lens, extend_starts))
    if out is None:
        out = torch.empty_like(q)
    check_tensor(op, "out", out, shape=q.shape, dims="[n, heads, d]", dtypes=(q.dtype,), device=dev)
    if max_extend_len < 0:
        raise ValueError(f"{op}: max_extend_len must be >= 0, got {max_extend_len}")
    if bs == 0 or max_extend_len == 0 or q.shape[0] == 0:
        return out

    block_d = max(16, next_pow2(head_dim))
    # 16-bit, head dim 128, one prompt of 2,048 or 4,096 tokens inside Llama-3.1-8B on an
    # H100 (loadtest/gpu/prefill.py): 128 queries x 32 keys, 4 warps, 3 stages took 4.7 and
    # 17.9 ms a prefill against 5.2 and 18.6 for the 64x64 tiles before, the best of five
    # configurations there (the kernel alone, on fresh contiguous slots, ranks 13 of them
    # differently and by wider margins). Extends of up to 64 tokens (decode rows with forced
    # text, short chunks) keep 64x64: the rows of a tile past a request's end are computed
    # and thrown away. fp32 and head dims over 128 take 32x32 to fit shared memory.
    small = q.dtype == torch.float32 or block_d > 128
    long_extend = not small and max_extend_len > 64
    block_m = block_m or (32 if small else 128 if long_extend else 64)
    block_n = block_n or (32 if small or long_extend else 64)
    check_tile(op, "block_m", block_m)
    check_tile(op, "block_n", block_n)
    num_warps = num_warps or 4
    num_stages = num_stages or (2 if small else 3)
    check_launch(op, num_warps, num_stages)
    grid = (bs, num_heads, triton.cdiv(max_extend_len, block_m))
    _extend_kernel[grid](
        q,
        k_buffer,
        v_buffer,
        out,
        req_to_token,
        req_rows,
        prefix_lens,
        extend_lens,
        extend_starts,
        sm_scale,
        window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        out.stride(0),
        out.stride(1),
        req_to_token.stride(0),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        HEAVY_FIRST=heavy_first,
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def extend_attention_ref(
    *,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The torch twin of `extend_attention`: per request, masked softmax in fp32.

    Rows of q that belong to no request are left as zeros."""
    group = q.shape[1] // k_buffer.shape[1]
    out = torch.zeros_like(q)
    for row, prefix, extend, start in zip(
        req_rows.tolist(),
        prefix_lens.tolist(),
        extend_lens.tolist(),
        extend_starts.tolist(),
        strict=True,
    ):
        if extend == 0:
            continue
        slots = req_to_token[row, : prefix + extend].long()
        # [seq, heads, d]; an fp8 pool dequantises by this cast (scale 1.0).
        keys = gather_kv(k_buffer, slots).float().repeat_interleave(group, dim=1)
        values = gather_kv(v_buffer, slots).float().repeat_interleave(group, dim=1)
        qi = q[start : start + extend].float()
        scores = torch.einsum("ihd,thd->hit", qi, keys) * sm_scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(prefix, prefix + extend, device=q.device)[None, :, None]
        k_pos = torch.arange(prefix + extend, device=q.device)[None, None, :]
        hidden = k_pos > q_pos
        if window is not None:
            hidden |= k_pos <= q_pos - window
        scores = scores.masked_fill(hidden, float("-inf"))
        out[start : start + extend] = torch.einsum("hit,thd->ihd", scores.softmax(-1), values).to(
            q.dtype
        )
    return out
