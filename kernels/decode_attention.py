"""Decode attention over the request-to-slot table, split along the sequence (flash-decoding).

Request b has one query token; head h attends over the K/V slots
`req_to_token[req_rows[b], :seq_lens[b]]` of one layer's pool buffers (KV head h // group).

Stage 1, grid (bs, num_kv_heads * head_blocks, max_kv_splits): program (b, g, s) takes up to
BLOCK_H query heads that share one KV head (so a GQA group loads each K/V tile once) and the
s-th of the request's `num_kv_splits[b]` chunks of context; it writes the chunk's normalised
partial output and log-sum-exp to the workspace. Stage 2, grid (bs, num_heads), merges the
chunks. Chunks are `cdiv(seq_len, splits)` rounded up to BLOCK_N, so trailing ones can be
empty: both stages skip them.

A sliding window (`window`) narrows the context to its last `window` keys: the chunks split
that range instead of the whole context. A softcap maps each score s to cap * tanh(s / cap).
Both are constexpr-gated, so a call without them compiles to the plain kernel.

The grid depends only on the batch size and the workspace, never on sequence lengths, and the
launch reads no tensor value on the host, so it can be captured in a CUDA graph.
"""

from __future__ import annotations

from dataclasses import dataclass

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
from kernels.fp8_kv import gather_kv, is_fp8
from kernels.fp8_widen import early_widening, widen_early
from kernels.pdl import pdl_launch, pdl_prologue

# Query heads per stage-1 program: tl.dot needs at least 16 rows, so a group smaller than
# that runs with masked rows (decode is memory-bound: the K/V loads are what count).
_BLOCK_H = 16
# With lazy_rescale, how far (in nats) a row's scores may rise past its running max before
# the max moves: probabilities stay below e^8 (about 3,000), well inside fp16.
RESCALE_AT: tl.constexpr = tl.constexpr(8.0)


@triton.jit
def _decode_stage1_kernel(
    q_ptr,
    k_buf_ptr,
    v_buf_ptr,
    req_to_token_ptr,
    req_rows_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    part_out_ptr,
    part_lse_ptr,
    sm_scale,
    window,
    softcap,
    stride_qb,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_rt,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    KV_PACK: tl.constexpr,
    MAX_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    F16_DOTS: tl.constexpr,
    EARLY_K: tl.constexpr,
    EARLY_V: tl.constexpr,
    E5M2: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    # KV_PACK adjacent KV heads a program; row r of its query block is query head
    # kv_head0 * GROUP + r, of local KV head r // GROUP.
    kv_head0 = (tl.program_id(1) // HEAD_BLOCKS) * KV_PACK
    split = tl.program_id(2)
    offs_g = (tl.program_id(1) % HEAD_BLOCKS) * BLOCK_H + tl.arange(0, BLOCK_H)
    heads = kv_head0 * GROUP + offs_g
    h_mask = offs_g < GROUP * KV_PACK
    row_kv = offs_g // GROUP
    # Columns: the packed heads' dims side by side; column c is dim c % BLOCK_D of local KV
    # head c // BLOCK_D. A row's query sits in its own head's columns, zeros elsewhere, so one
    # dot over all columns gives each row its own head's scores.
    offs_c = tl.arange(0, KV_PACK * BLOCK_D)
    col_kv = offs_c // BLOCK_D
    offs_d = offs_c % BLOCK_D
    d_mask = offs_d < HEAD_DIM
    kv_cols = (kv_head0 + col_kv) * stride_kh + offs_d
    v_cols = (kv_head0 + col_kv) * stride_vh + offs_d
    own = h_mask[:, None] & (row_kv[:, None] == col_kv[None, :]) & d_mask[None, :]

    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    num_splits = tl.minimum(tl.maximum(tl.load(num_splits_ptr + b).to(tl.int32), 1), MAX_SPLITS)
    # With a window, the query (at seq_len - 1) sees keys [seq_len - window, seq_len).
    kv_start = tl.maximum(seq_len - window, 0) if USE_WINDOW else 0
    split_len = tl.cdiv(tl.cdiv(seq_len - kv_start, num_splits), BLOCK_N) * BLOCK_N
    start = kv_start + split * split_len
    end = tl.minimum(start + split_len, seq_len)
    if start < end:
        row = tl.load(req_rows_ptr + b).to(tl.int64)
        q_offs = b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :]
        q = tl.load(q_ptr + q_offs, mask=own, other=0.0)
        if F16_DOTS:
            # fp8 K/V widen to fp16 exactly and cheaply (e5m2 is fp16's top byte); bf16 would
            # go through fp32. q within fp16's range: the clamp only guards against overflow.
            q = tl.clamp(q.to(tl.float32), -65504.0, 65504.0).to(tl.float16)

        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, KV_PACK * BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            n_mask = offs_n < end
            slots = tl.load(req_to_token_ptr + row * stride_rt + offs_n, mask=n_mask, other=0)
            slots = slots.to(tl.int64)
            # K loaded transposed, [columns, BLOCK_N], ready for q @ k.
            k_offs = slots[None, :] * stride_kt + kv_cols[:, None]
            k = tl.load(k_buf_ptr + k_offs, mask=d_mask[:, None] & n_mask[None, :], other=0.0)
            if EARLY_K:
                k = widen_early(k, E5M2)
            qk = tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION) * sm_scale
            if USE_SOFTCAP:
                qk = tanh(qk / softcap) * softcap
            qk = tl.where(n_mask[None, :], qk, float("-inf"))
            # Every row sees at least one key of the first tile, so its max is finite.
            m_tile = tl.max(qk, 1)
            if LAZY_RESCALE:
                # The running max moves (and acc is rescaled) only when some row's scores
                # rose RESCALE_AT past it; otherwise p is taken against the stale max (at most
                # e^RESCALE_AT) and the final acc / l_i is the same softmax.
                if tl.max(m_tile - m_i, 0) > RESCALE_AT:
                    m_new = tl.maximum(m_i, m_tile)
                    alpha = tl.exp(m_i - m_new)
                    acc = acc * alpha[:, None]
                    l_i = l_i * alpha
                    m_i = m_new
                p = tl.exp(qk - m_i[:, None])
            else:
                m_new = tl.maximum(m_i, m_tile)
                alpha = tl.exp(m_i - m_new)
                p = tl.exp(qk - m_new[:, None])
            v_offs = slots[:, None] * stride_vt + v_cols[None, :]
            v = tl.load(v_buf_ptr + v_offs, mask=n_mask[:, None] & d_mask[None, :], other=0.0)
            if EARLY_V:  # fp16 in shared memory: ldmatrix can transpose it (fp8_widen.py)
                v = widen_early(v, E5M2)
            if LAZY_RESCALE:
                acc = tl.dot(p.to(q.dtype), v.to(q.dtype), acc, input_precision=DOT_PRECISION)
                l_i = l_i + tl.sum(p, 1)
            else:
                pv = tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PRECISION)
                acc = acc * alpha[:, None] + pv
                l_i = l_i * alpha + tl.sum(p, 1)
                m_i = m_new

        # Each row keeps its own head's columns of acc.
        o_offs = b.to(tl.int64) * stride_ob + heads[:, None] * stride_oh + split * stride_os
        tl.store(part_out_ptr + o_offs + offs_d[None, :], acc / l_i[:, None], mask=own)
        l_offs = b.to(tl.int64) * stride_lb + heads * stride_lh + split
        tl.store(part_lse_ptr + l_offs, m_i + tl.log(l_i), mask=h_mask)


@triton.jit
def _decode_stage2_kernel(
    part_out_ptr,
    part_lse_ptr,
    out_ptr,
    seq_lens_ptr,
    num_splits_ptr,
    window,
    stride_ob,
    stride_oh,
    stride_os,
    stride_lb,
    stride_lh,
    stride_outb,
    stride_outh,
    MAX_SPLITS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
    BLOCK_D: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    d_mask = offs_d < HEAD_DIM

    # The same chunking as stage 1: chunk s holds keys iff s * split_len < the keys seen.
    seq_len = tl.load(seq_lens_ptr + b).to(tl.int32)
    num_splits = tl.minimum(tl.maximum(tl.load(num_splits_ptr + b).to(tl.int32), 1), MAX_SPLITS)
    kv_len = tl.minimum(seq_len, window) if USE_WINDOW else seq_len
    split_len = tl.cdiv(tl.cdiv(kv_len, num_splits), BLOCK_N) * BLOCK_N
    s_mask = (offs_s < num_splits) & (offs_s * split_len < kv_len)

    base_l = b.to(tl.int64) * stride_lb + h * stride_lh
    lse = tl.load(part_lse_ptr + base_l + offs_s, mask=s_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m > float("-inf"), m, 0.0)  # seq_len 0 (a padded request): output zeros
    w = tl.where(s_mask, tl.exp(lse - m), 0.0)
    base_o = b.to(tl.int64) * stride_ob + h * stride_oh
    o_offs = base_o + offs_s[:, None] * stride_os + offs_d[None, :]
    o = tl.load(part_out_ptr + o_offs, mask=s_mask[:, None] & d_mask[None, :], other=0.0)
    acc = tl.sum(w[:, None] * o, 0)
    denom = tl.maximum(tl.sum(w, 0), 1e-30)
    out_offs = b.to(tl.int64) * stride_outb + h * stride_outh + offs_d
    tl.store(out_ptr + out_offs, (acc / denom).to(out_ptr.dtype.element_ty), mask=d_mask)


@dataclass(frozen=True)
class DecodeWorkspace:
    """fp32 scratch for the per-chunk partial results; allocate once for the largest batch.

    partial_out: [max_bs, num_heads, max_kv_splits, head_dim]
    partial_lse: [max_bs, num_heads, max_kv_splits]
    """

    partial_out: torch.Tensor
    partial_lse: torch.Tensor

    @classmethod
    def allocate(
        cls,
        *,
        max_batch_size: int,
        num_heads: int,
        head_dim: int,
        max_kv_splits: int,
        device: torch.device | str,
    ) -> DecodeWorkspace:
        shape = (max_batch_size, num_heads, max_kv_splits)
        return cls(
            partial_out=torch.empty((*shape, head_dim), dtype=torch.float32, device=device),
            partial_lse=torch.empty(shape, dtype=torch.float32, device=device),
        )

    @property
    def max_batch_size(self) -> int:
        return int(self.partial_out.shape[0])

    @property
    def max_kv_splits(self) -> int:
        return int(self.partial_out.shape[2])


def num_kv_splits_for(
    seq_lens: torch.Tensor, *, max_kv_splits: int, min_split_len: int
) -> torch.Tensor:
    """Chunks per request: one per `min_split_len` keys, 1 to `max_kv_splits`: [bs] int32.

    Computed on the device from `seq_lens`, with no host sync.
    """
    splits = torch.div(seq_lens + (min_split_len - 1), min_split_len, rounding_mode="floor")
    return splits.clamp(1, max_kv_splits).to(torch.int32)


def decode_attention(
    *,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    workspace: DecodeWorkspace,
    sm_scale: float,
    out: torch.Tensor | None = None,
    block_n: int | None = None,
    num_stages: int = 2,
    num_warps: int = 4,
    window: int | None = None,
    softcap: float | None = None,
    f16_dots: bool | None = None,
    kv_pack: int | None = None,
    early_k: bool = False,
    early_v: bool = False,
    lazy_rescale: bool = False,
) -> torch.Tensor:
    """Attention of each request's one query over its context; returns `out`.

    q: [bs, num_heads, head_dim]; out (optional, written): the same shape, q's dtype.
    k_buffer, v_buffer: [num_slots, num_kv_heads, head_dim], num_heads % num_kv_heads == 0.
    req_to_token: [max_reqs, max_context]; req_rows, seq_lens, num_kv_splits: [bs] ints
    (num_kv_splits is clamped to 1..workspace.max_kv_splits; see `num_kv_splits_for`).
    A request with seq_len 0 gets zeros. workspace: at least bs rows, num_heads, head_dim.
    block_n: keys per inner step (a power of two >= 16, default 32).
    num_stages, num_warps: stage 1's software pipelining depth and warps per program.
    window (optional, >= 1): each query sees only the last `window` keys of its context.
    softcap (optional, > 0): scores s become softcap * tanh(s / softcap).
    f16_dots: products in fp16 (q, the widened K/V, the probabilities; fp32 sums). None: for
    an fp8 cache under bf16 queries, where widening fp8 to bf16 goes through fp32 and cost
    the kernel its bandwidth.
    kv_pack: adjacent KV heads one program reads together (1, 2 or 4; it must divide the KV
    heads, and their query heads fit one 16-row block), so each key's rows of those heads are
    one contiguous load. None: `choose_kv_pack`.
    early_k, early_v (fp8 pools): widen the K (V) tiles to fp16 before they go through shared
    memory (kernels/fp8_widen.py: inline PTX, so an NVIDIA GPU, compute capability 8.9 or
    newer for e4m3) rather than after, as Triton does.
    lazy_rescale: move each row's running max (and rescale its sums) only when its scores
    rise more than RESCALE_AT past it, which skips the rescale of most tiles.
    """
    op = "decode_attention"
    check_window_softcap(op, window, softcap)
    num_heads, head_dim, num_kv_heads = check_attention_inputs(
        op, q, k_buffer, v_buffer, req_to_token, "[bs, heads, d]"
    )
    dev = q.device
    bs = q.shape[0]
    check_decode_state(
        op, bs, num_heads, head_dim, dev, (req_rows, seq_lens, num_kv_splits), workspace
    )
    ws_out, ws_lse = workspace.partial_out, workspace.partial_lse
    if out is None:
        out = torch.empty_like(q)
    check_tensor(
        op, "out", out, shape=q.shape, dims="[bs, heads, d]", dtypes=(q.dtype,), device=dev
    )
    if bs == 0:
        return out

    block_d = max(16, next_pow2(head_dim))
    if block_n is None:
        block_n = 32  # measured on an H200 (bf16, head dim 128): a little ahead of 64
    check_tile(op, "block_n", block_n)
    check_launch(op, num_warps, num_stages)
    group = num_heads // num_kv_heads
    if kv_pack is None:
        kv_pack = choose_kv_pack(bs, group, num_kv_heads, head_dim * k_buffer.element_size())
    check_kv_pack(op, kv_pack, group, num_kv_heads)
    head_blocks = triton.cdiv(group * kv_pack, _BLOCK_H)
    max_splits = workspace.max_kv_splits
    if f16_dots is None:
        f16_dots = is_fp8(k_buffer.dtype) and q.dtype == torch.bfloat16
    if (early_k or early_v) and not is_fp8(k_buffer.dtype):
        raise ValueError(f"{op}: early_k and early_v apply to fp8 pools, not {k_buffer.dtype}")
    if (early_k or early_v) and not early_widening(k_buffer.dtype, dev):
        raise ValueError(
            f"{op}: early_k and early_v need an NVIDIA GPU (compute capability 8.9 or newer "
            f"for float8_e4m3fn), not the interpreter"
        )
    _decode_stage1_kernel[(bs, num_kv_heads // kv_pack * head_blocks, max_splits)](
        q,
        k_buffer,
        v_buffer,
        req_to_token,
        req_rows,
        seq_lens,
        num_kv_splits,
        ws_out,
        ws_lse,
        sm_scale,
        window or 0,
        softcap or 1.0,
        q.stride(0),
        q.stride(1),
        k_buffer.stride(0),
        k_buffer.stride(1),
        v_buffer.stride(0),
        v_buffer.stride(1),
        req_to_token.stride(0),
        ws_out.stride(0),
        ws_out.stride(1),
        ws_out.stride(2),
        ws_lse.stride(0),
        ws_lse.stride(1),
        GROUP=group,
        HEAD_BLOCKS=head_blocks,
        KV_PACK=kv_pack,
        MAX_SPLITS=max_splits,
        HEAD_DIM=head_dim,
        BLOCK_H=_BLOCK_H,
        BLOCK_N=block_n,
        BLOCK_D=block_d,
        DOT_PRECISION=dot_precision(q.dtype),
        USE_WINDOW=window is not None,
        USE_SOFTCAP=softcap is not None,
        F16_DOTS=f16_dots,
        EARLY_K=early_k,
        EARLY_V=early_v,
        E5M2=k_buffer.dtype == torch.float8_e5m2,
        LAZY_RESCALE=lazy_rescale,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl_launch(q.device),
    )
    merge_splits(workspace, out, seq_lens, num_kv_splits, head_dim, block_n, block_d, window)
    return out


def choose_kv_pack(bs: int, group: int, num_kv_heads: int, row_bytes: int) -> int:
    """KV heads a stage-1 program reads together (`kv_pack`), for a key row of `row_bytes` a
    head. A program's loads are one row of each of its heads per key, and a load of a single
    fp8 row (128 bytes at head dim 128) leaves the kernel bound by its loads' count rather
    than their bytes. Measured on an H100 (Llama-3.1-8B's heads, 2026-11-27,
    `loadtest/results/gpu_decode_pack_h100_run1.json`), microseconds a layer, packs 1 / 2 / 4:
    - fp8: 154 x 2,800 keys 515 / 455 / 411; 256 x 640 355 / 274 / 231; 16 x 8,000
      137 / 135 / 127; 1 x 32,000 39.3 / 36.7 / 48.7
    - bf16: 154 x 2,800 694 / 653 / 637; 256 x 640 416 / 344 / 309; 16 x 8,000
      192 / 194 / 196; 1 x 32,000 50.8 / 55.7 / 59.0
    So: every head the rows allow for large batches (from 64 requests; from 16 for rows of
    128 bytes or less); otherwise rows of 256 bytes, since a small batch also needs programs
    enough to fill the GPU. Never past 1 KB a key (the largest measured: its K and V tiles'
    pipeline stages must fit the shared memory; Gemma 2's 256-wide bf16 heads pack by 2)."""
    best = 1
    for pack in (2, 4):
        if _pack_fits(pack, group, num_kv_heads) and pack * row_bytes <= 1024:
            best = pack
    if bs >= 64 or (row_bytes <= 128 and bs >= 16):
        return best
    return min(best, max(1, 256 // row_bytes))


def _pack_fits(kv_pack: int, group: int, num_kv_heads: int) -> bool:
    """Whether the kernel can pack `kv_pack` KV heads: they divide the KV heads, and their
    query heads fit one block of rows (one head always fits: its group spans blocks)."""
    return kv_pack == 1 or (num_kv_heads % kv_pack == 0 and group * kv_pack <= _BLOCK_H)


def check_kv_pack(op: str, kv_pack: int, group: int, num_kv_heads: int) -> None:
    if kv_pack not in (1, 2, 4):
        raise ValueError(f"{op}: kv_pack must be 1, 2 or 4, got {kv_pack}")
    if _pack_fits(kv_pack, group, num_kv_heads):
        return
    if num_kv_heads % kv_pack:
        raise ValueError(f"{op}: kv_pack {kv_pack} does not divide the {num_kv_heads} KV heads")
    if group * kv_pack > _BLOCK_H:
        raise ValueError(
            f"{op}: kv_pack {kv_pack} x {group} query heads per KV head exceeds one program's "
            f"{_BLOCK_H} rows"
        )


def check_decode_state(
    op: str,
    bs: int,
    num_heads: int,
    head_dim: int,
    dev: torch.device,
    tables: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    workspace: DecodeWorkspace,
) -> None:
    """A split-KV decode's per-request tables (req_rows, seq_lens, num_kv_splits: [bs] ints)
    and its workspace (fp32 partials for at least bs rows of `num_heads` x `head_dim`); the
    MLA decode (kernels/mla_decode.py) shares them."""
    for name, t in zip(("req_rows", "seq_lens", "num_kv_splits"), tables, strict=True):
        check_tensor(op, name, t, shape=(bs,), dims="[bs]", dtypes=INDEX_DTYPES, device=dev)
    ws_out, ws_lse = workspace.partial_out, workspace.partial_lse
    if (
        ws_out.dim() != 4
        or ws_out.shape[0] < bs
        or ws_out.shape[1] != num_heads
        or ws_out.shape[3] != head_dim
        or ws_lse.shape != ws_out.shape[:3]
        or ws_out.dtype != torch.float32
        or ws_lse.dtype != torch.float32
        or ws_out.stride(-1) != 1
        or ws_lse.stride(-1) != 1
        or ws_out.device != dev
        or ws_lse.device != dev
    ):
        raise ValueError(
            f"{op}: workspace must be fp32 on {dev}, partial_out [>= {bs}, {num_heads}, "
            f"splits, {head_dim}] and partial_lse [>= {bs}, {num_heads}, splits], got "
            f"{tuple(ws_out.shape)} {ws_out.dtype} and {tuple(ws_lse.shape)} {ws_lse.dtype}"
        )


def merge_splits(
    workspace: DecodeWorkspace,
    out: torch.Tensor,
    seq_lens: torch.Tensor,
    num_kv_splits: torch.Tensor,
    head_dim: int,
    block_n: int,
    block_d: int,
    window: int | None = None,
) -> None:
    """Stage 2 of a split-KV decode: each request's chunk partials (workspace) merged by
    their log-sum-exps into out [bs, heads, head_dim]; the chunking (block_n, window) must be
    stage 1's."""
    ws_out, ws_lse = workspace.partial_out, workspace.partial_lse
    max_splits = workspace.max_kv_splits
    _decode_stage2_kernel[(out.shape[0], out.shape[1])](
        ws_out,
        ws_lse,
        out,
        seq_lens,
        num_kv_splits,
        window or 0,
        ws_out.stride(0),
        ws_out.stride(1),
        ws_out.stride(2),
        ws_lse.stride(0),
        ws_lse.stride(1),
        out.stride(0),
        out.stride(1),
        MAX_SPLITS=max_splits,
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        BLOCK_S=next_pow2(max_splits),
        BLOCK_D=block_d,
        USE_WINDOW=window is not None,
        num_warps=4,
        **pdl_launch(ws_out.device),
    )


def decode_attention_ref(
    *,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    req_rows: torch.Tensor,
    seq_lens: torch.Tensor,
    sm_scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """The torch twin of `decode_attention`: per request, softmax in fp32 (syncs the host)."""
    group = q.shape[1] // k_buffer.shape[1]
    out = torch.zeros_like(q)
    for b, (row, seq_len) in enumerate(zip(req_rows.tolist(), seq_lens.tolist(), strict=True)):
        if seq_len == 0:
            continue
        start = max(seq_len - window, 0) if window is not None else 0
        slots = req_to_token[row, start:seq_len].long()
        # [seq, heads, d]; an fp8 pool dequantises by this cast (scale 1.0).
        keys = gather_kv(k_buffer, slots).float().repeat_interleave(group, dim=1)
        values = gather_kv(v_buffer, slots).float().repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,thd->ht", q[b].float(), keys) * sm_scale
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        out[b] = torch.einsum("ht,thd->hd", scores.softmax(-1), values).to(q.dtype)
    return out
