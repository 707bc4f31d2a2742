"""Extend (prefill) attention for DeepSeek's latent attention (MLA), weights absorbed.

The new tokens of request b sit at rows extend_starts[b] .. + extend_lens[b] of q; new token
i is at position prefix_lens[b] + i and sees positions 0 .. prefix_lens[b] + i of the latent
rows `buf[req_to_token[req_rows[b], :]]`, the new tokens' rows already stored. A row is
`rank` latent elements then `rope` rotated ones: the key is the row, the value its latent
part; a query is `rank + rope` wide and the output `rank` wide, as in mla_decode.py.

Grid: (bs, num_heads, cdiv(max_extend_len, BLOCK_M)); a program takes BLOCK_M new tokens of
one request and one head, walks the keys up to its last query with an online softmax and a
causal mask on every tile (cheap beside the 512-wide products), and returns at once past its
request's new tokens. Prefill attention over the latent costs more arithmetic than over
expanded K/V (576-wide keys for each of the heads): this kernel is for correctness and short
prefills first; SGLang expands K/V for long ones.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import (
    FLOAT_DTYPES,
    INDEX_DTYPES,
    check_device,
    check_launch,
    check_tensor,
    check_tile,
    dot_precision,
    next_pow2,
)
from kernels.extend_attention import check_extend_tables
from kernels.fp8_kv import FP8_FORMATS, gather_kv


@triton.jit
def _mla_extend_kernel(
    q_ptr,
    buf_ptr,
    out_ptr,
    req_to_token_ptr,
    req_rows_ptr,
    prefix_lens_ptr,
    extend_lens_ptr,
    extend_starts_ptr,
    sm_scale,
    stride_qt,
    stride_qh,
    stride_bt,
    stride_outt,
    stride_outh,
    stride_rt,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(0)
    head = tl.program_id(1)
    m_start = tl.program_id(2) * BLOCK_M
    extend_len = tl.load(extend_lens_ptr + b).to(tl.int32)
    if m_start < extend_len:
        prefix = tl.load(prefix_lens_ptr + b).to(tl.int32)
        first_tok = tl.load(extend_starts_ptr + b).to(tl.int64)
        table_row_ptr = req_to_token_ptr + tl.load(req_rows_ptr + b).to(tl.int64) * stride_rt
        offs_m = m_start + tl.arange(0, BLOCK_M)
        m_mask = offs_m < extend_len
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        offs_p = tl.arange(0, BLOCK_P)
        p_mask = offs_p < ROPE
        tok = first_tok + offs_m
        q_base = q_ptr + tok[:, None] * stride_qt + head * stride_qh
        q_lat = tl.load(q_base + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0)
        q_pe = tl.load(
            q_base + RANK + offs_p[None, :], mask=m_mask[:, None] & p_mask[None, :], other=0.0
        )
        q_pos = prefix + offs_m  # each query sees keys at positions <= q_pos
        qk_scale = sm_scale * 1.4426950408889634  # log2(e): exp2 is the native instruction

        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        end = prefix + tl.minimum(extend_len, m_start + BLOCK_M)
        for n0 in range(0, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(table_row_ptr + offs_n, mask=n_mask, other=0).to(tl.int64)
            rows = buf_ptr + slots[None, :] * stride_bt
            lat = tl.load(rows + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            lat = lat.to(q_lat.dtype)
            pe = tl.load(
                rows + RANK + offs_p[:, None], mask=p_mask[:, None] & n_mask[None, :], other=0.0
            )
            qk = tl.dot(q_lat, lat, input_precision=DOT_PRECISION)
            qk += tl.dot(q_pe, pe.to(q_pe.dtype), input_precision=DOT_PRECISION)
            visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
            qk = tl.where(visible, qk * qk_scale, float("-inf"))
            # Every row (padding rows too) sees key 0 in the first tile, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            pv = tl.dot(p.to(q_lat.dtype), tl.trans(lat), input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        out_offs = tok[:, None] * stride_outt + head * stride_outh + offs_r[None, :]
        tl.store(
            out_ptr + out_offs,
            (acc / l_i[:, None]).to(out_ptr.dtype.element_ty),
            mask=m_mask[:, None] & r_mask[None, :],
        )


def check_mla_inputs(
    op: str, q: torch.Tensor, buffer: torch.Tensor, rank: int, req_to_token: torch.Tensor, dims: str
) -> tuple[int, int]:
    """q [n, heads, rank + rope] and the latent pool [slots, 1, rank + rope] (fp8 too), last
    dimensions contiguous; returns (num_heads, rope)."""
    check_tensor(op, "q", q, shape=(None, None, None), dims=dims, dtypes=FLOAT_DTYPES)
    check_device(op, q)
    width = q.shape[2]
    if not 0 < rank < width:
        raise ValueError(f"{op}: rank {rank} must be below q's last dimension {width}")
    check_tensor(
        op, "buffer", buffer, shape=(None, 1, width), dims="[slots, 1, rank + rope]",
        dtypes=(q.dtype, *FP8_FORMATS), device=q.device,
    )  # fmt: skip
    check_tensor(
        op, "req_to_token", req_to_token, shape=(None, None), dims="[reqs, context]",
        dtypes=INDEX_DTYPES, device=q.device,
    )  # fmt: skip
    return q.shape[1], width - rank


def mla_extend(
    *,
    q: torch.Tensor,
    buffer: torch.Tensor,
    rank: int,
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
) -> torch.Tensor:
    """Causal latent attention of the new tokens over prefix + new tokens; returns `out`.

    q: [num_tokens, num_heads, rank + rope] (any token/head strides); buffer: [num_slots, 1,
    rank + rope], the new tokens' rows already stored; out (optional, written): [num_tokens,
    num_heads, rank] in q's dtype. req_rows, prefix_lens, extend_lens, extend_starts: [bs]
    ints; max_extend_len >= every extend_lens[b] (sizes the grid; not checked, as that would
    sync). block_m, block_n: powers of two >= 16.
    """
    op = "mla_extend"
    num_heads, rope = check_mla_inputs(op, q, buffer, rank, req_to_token, "[n, heads, d]")
    dev = q.device
    bs = check_extend_tables(op, dev, (req_rows, prefix_lens, extend_lens, extend_starts))
    if out is None:
        out = q.new_empty(q.shape[0], num_heads, rank)
    check_tensor(
        op, "out", out, shape=(q.shape[0], num_heads, rank), dims="[n, heads, rank]",
        dtypes=(q.dtype,), device=dev,
    )  # fmt: skip
    if max_extend_len < 0:
        raise ValueError(f"{op}: max_extend_len must be >= 0, got {max_extend_len}")
    if bs == 0 or max_extend_len == 0 or q.shape[0] == 0:
        return out
    # A [BLOCK_M, 512] fp32 accumulator per program: small query tiles, more warps.
    block_r = max(16, next_pow2(rank))
    small = q.dtype == torch.float32 or block_r > 256
    block_m = block_m or (16 if small else 32)
    block_n = block_n or (16 if small else 32)
    check_tile(op, "block_m", block_m)
    check_tile(op, "block_n", block_n)
    num_warps = num_warps or (8 if block_r > 256 else 4)
    num_stages = num_stages or 2
    check_launch(op, num_warps, num_stages)
    _mla_extend_kernel[(bs, num_heads, triton.cdiv(max_extend_len, block_m))](
        q, buffer, out, req_to_token, req_rows, prefix_lens, extend_lens, extend_starts,
        sm_scale,
        q.stride(0), q.stride(1), buffer.stride(0), out.stride(0), out.stride(1),
        req_to_token.stride(0),
        RANK=rank,
        ROPE=rope,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=max(16, next_pow2(rope)),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
    )  # fmt: skip
    return out


def mla_extend_ref(
    *,
    q: torch.Tensor,
    buffer: torch.Tensor,
    rank: int,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    prefix_lens: torch.Tensor,
    extend_lens: torch.Tensor,
    extend_starts: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """The torch twin of `mla_extend`: per request, masked softmax in fp32. Rows of q that
    belong to no request are left as zeros."""
    out = q.new_zeros(q.shape[0], q.shape[1], rank)
    for row, prefix, extend, start in zip(
        req_rows.tolist(),
        prefix_lens.tolist(),
        extend_lens.tolist(),
        extend_starts.tolist(),
        strict=True,
    ):
        if extend == 0:
            continue
        keys = gather_kv(buffer, req_to_token[row, : prefix + extend].long())[:, 0].float()
        qi = q[start : start + extend].float()  # [extend, heads, rank + rope]
        scores = torch.einsum("ihd,td->hit", qi, keys) * sm_scale
        q_pos = torch.arange(prefix, prefix + extend, device=q.device)
        k_pos = torch.arange(prefix + extend, device=q.device)
        scores = scores.masked_fill(k_pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        attn = torch.einsum("hit,td->ihd", scores.softmax(-1), keys[:, :rank])
        out[start : start + extend] = attn.to(q.dtype)
    return out
