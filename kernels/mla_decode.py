"""Decode attention for DeepSeek's latent attention (MLA), weights absorbed, split along the
sequence (flash-decoding).

Every head of request b attends, MQA, over the latent rows `buf[req_to_token[req_rows[b],
:seq_lens[b]]]` of one layer: a row is `rank` latent elements then `rope` rotated ones, the
key is the whole row and the value its latent part. A query is `rank + rope` wide (the head's
query times W_UK, then its rotated part) and the output is `rank` wide (W_UV comes after).

Stage 1, grid (bs, cdiv(num_heads, BLOCK_H), max_kv_splits): program (b, g, s) takes BLOCK_H
heads, which all read the same rows, so each latent tile is loaded once for all of them, and
the s-th of the request's `num_kv_splits[b]` chunks of its context; it writes the chunk's
normalised partial output and log-sum-exp. Stage 2 is decode_attention's merge (the same
workspace layout, with `rank` as the head dim). A batch of a few requests has only
bs * cdiv(heads, 16) programs per chunk, so splitting the context is what fills the GPU.

The grid depends only on the batch size and the workspace, never on sequence lengths, and the
launch reads no tensor value on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor, check_tile, dot_precision, next_pow2
from kernels.decode_attention import DecodeWorkspace, check_decode_state, merge_splits
from kernels.fp8_kv import gather_kv
from kernels.mla_extend import check_mla_inputs
from kernels.pdl import pdl_launch, pdl_prologue

_BLOCK_H = 16  # heads per stage-1 program (tl.dot needs 16 rows; fewer heads are masked)


@triton.jit
def _mla_decode_stage1_kernel(
    q_ptr,
    buf_ptr,
    req_to_token_ptr,
    req_rows_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    part_out_ptr,
    part_lse_ptr,
    sm_scale,
    num_heads,
    stride_qb,
    stride_qh,
    stride_bt,
    stride_rt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    MAX_SPLITS: tl.constexpr,
    RANK: tl.constexpr,
    ROPE: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(2)
    h_mask = heads < num_heads
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < RANK
    offs_p = tl.arange(0, BLOCK_P)
    p_mask = offs_p < ROPE

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    num_splits = tl.minimum(tl.maximum(tl.load(num_splits_ptr + b).to(tl.int32), 1), MAX_SPLITS)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        row = tl.load(req_rows_ptr + b).to(tl.int64)
        q_base = q_ptr + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh
        q_lat = tl.load(q_base + offs_r[None, :], mask=h_mask[:, None] & r_mask[None, :], other=0.0)
        q_pe = tl.load(
            q_base + RANK + offs_p[None, :], mask=h_mask[:, None] & p_mask[None, :], other=0.0
        )

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_R], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=n_mask, other=0)
            rows = buf_ptr + slots.to(tl.int64)[None, :] * stride_bt
            # Latent and rotated keys loaded transposed, [d, BLOCK_N], ready for q @ k.
            lat = tl.load(rows + offs_r[:, None], mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            lat = lat.to(q_lat.dtype)
            pe = tl.load(
                rows + RANK + offs_p[:, None], mask=p_mask[:, None] & n_mask[None, :], other=0.0
            )
            qk = tl.dot(q_lat, lat, input_precision=DOT_PRECISION)
            qk += tl.dot(q_pe, pe.to(q_pe.dtype), input_precision=DOT_PRECISION)
            qk = tl.where(n_mask[None, :], qk * sm_scale, float("-inf"))
            # Every row sees at least one key of the first tile, so m_new is finite.
            m_new = tl.maximum(m_i, tl.max(qk, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(qk - m_new[:, None])
            # The values are the latent tile already loaded.
            pv = tl.dot(p.to(q_lat.dtype), tl.trans(lat), input_precision=DOT_PRECISION)
            acc = acc * alpha[:, None] + pv
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

        o_offs = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
        tl.store(
            part_out_ptr + o_offs + offs_r[None, :],
            acc / l_i[:, None],
            mask=h_mask[:, None] & r_mask[None, :],
        )
        l_offs = b.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(part_lse_ptr + l_offs, m_i + tl.log(l_i), mask=h_mask)


def mla_decode(
    *,
    q: torch.Tensor,
    buffer: torch.Tensor,
    rank: int,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    workspace: DecodeWorkspace,
    sm_scale: float,
    out: torch.Tensor | None = None,
    block_n: int = 32,
    num_stages: int = 2,
    num_warps: int = 4,
) -> torch.Tensor:
    """Latent attention of each request's one query over its context; returns `out`.

    q: [bs, num_heads, rank + rope]; buffer: [num_slots, 1, rank + rope] (the latent pool of
    one layer); out (optional, written): [bs, num_heads, rank] in q's dtype. req_to_token:
    [max_reqs, max_context]; req_rows, seq_lens, num_kv_splits: [bs] ints (num_kv_splits is
    clamped to 1..workspace.max_kv_splits; decode_attention.num_kv_splits_for computes it).
    A request with seq_len 0 gets zeros. workspace: at least bs rows, num_heads, head dim
    `rank`. block_n: keys per inner step (a power of two >= 16).
    """
    op = "mla_decode"
    num_heads, rope = check_mla_inputs(op, q, buffer, rank, req_to_token, "[bs, heads, d]")
    dev, bs = q.device, q.shape[0]
    check_decode_state(op, bs, num_heads, rank, dev, (req_rows, seq_lens, num_kv_splits), workspace)
    ws_out, ws_lse = workspace.partial_out, workspace.partial_lse
    if out is None:
        out = q.new_empty(bs, num_heads, rank)
    check_tensor(
        op, "out", out, shape=(bs, num_heads, rank), dims="[bs, heads, rank]",
        dtypes=(q.dtype,), device=dev,
    )  # fmt: skip
    if bs == 0:
        return out
    check_tile(op, "block_n", block_n)
    check_launch(op, num_warps, num_stages)
    max_splits = workspace.max_kv_splits
    block_r = max(16, next_pow2(rank))
    _mla_decode_stage1_kernel[(bs, triton.cdiv(num_heads, _BLOCK_H), max_splits)](
        q, buffer, req_to_token, req_rows, seq_lens, num_kv_splits, ws_out, ws_lse,
        sm_scale, num_heads,
        q.stride(0), q.stride(1), buffer.stride(0), req_to_token.stride(0),
        ws_out.stride(0), ws_out.stride(1), ws_out.stride(2), ws_lse.stride(0), ws_lse.stride(1),
        MAX_SPLITS=max_splits,
        RANK=rank,
        ROPE=rope,
        BLOCK_H=_BLOCK_H,
        BLOCK_N=block_n,
        BLOCK_R=block_r,
        BLOCK_P=max(16, next_pow2(rope)),
        DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(q.device),
    )  # fmt: skip
    merge_splits(workspace, out, seq_lens, num_kv_splits, rank, block_n, block_r)
    return out


def mla_decode_ref(
    *,
    q: torch.Tensor,
    buffer: torch.Tensor,
    rank: int,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
) -> torch.Tensor:
    """The torch twin of `mla_decode`: per request, softmax in fp32 (syncs the host)."""
    out = q.new_zeros(q.shape[0], q.shape[1], rank)
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist(), strict=True)):
        if seq_len == 0:
            continue
        # [seq, rank + rope]; an fp8 pool dequantises by this cast (scale 1.0).
        keys = gather_kv(buffer, req_to_token[row, :seq_len].long())[:, 0].float()
        scores = (q[b].float() @ keys.T) * sm_scale  # [heads, seq]
        out[b] = (scores.softmax(-1) @ keys[:, :rank]).to(q.dtype)
    return out
