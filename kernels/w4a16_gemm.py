"""Dequantising matmul on the tensor cores for decode batches past the GEMV's rows: out = x @
w.T for up to a few dozen rows of x, w int4 in the layout of kernels/w4a16.py.

Decode batches of 5 to 64 requests still only need to read w once: the products are few, and
the GEMV's cost grows with every row of x (one fused multiply-add a weight a row), the
dequantise-then-cuBLAS path writes and reads the weight again in 16 bits. Here the weight is
the MMA's M side and x its N side (out.T = w @ x.T), so a tile of 16 rows of x costs the
tensor cores what one row does:

- a nibble becomes a 16-bit float in one AND-OR: q OR-ed into the mantissa of OFF (128 in
  bf16, 1024 in fp16) spells OFF + q exactly (fp32 x converts q itself). The 8 nibbles of a
  word are joined along a new innermost dimension in the thread that loaded the word
  (kernels/w4a16.py's `words_in_column_order`, as the dequantize kernel does), which puts
  the tile's columns in their own order (8i + j), so a step is one product of K = 8 BLOCK_W
  against x's contiguous columns;
- the zero point, the offset and the scale are applied once per step to the step's sums, a
  step lying in one quantisation group: sum_k s (q_k - z) x_k = s (sum_k (OFF + q_k) x_k -
  (OFF + z) sum_k x_k). Groups shorter than a step (16 to 64 columns) take the tile as nibble
  planes instead (plane j: nibble j of every word, the columns 8i + j, each its own product
  of K = BLOCK_W against x's columns gathered in that order), dequantised per word,
  (q - z) s;
- K is split across SPLIT programs (kernels/split_k.py): a program's loop is a chain of
  dependent loads and products, and short chains in many programs keep more loads in flight.
  Each writes its fp32 partial sums to a workspace and a second launch adds them in order (no
  atomics: the same sums every call) and rounds to out's dtype.

Grid: (cdiv(M, BLOCK_M), cdiv(N, BLOCK_N) * SPLIT): the programs that read one tile of words
(its tiles of x's rows) side by side, so that the L2 serves the words to all but the first.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import check_launch, check_tensor, check_tile, dot_precision, sm_count
from kernels.gather_cols import gather_columns
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.split_k import plan, program_tile, store_tile, sum_splits, workspace
from kernels.w4a16 import PACK, check_w4, words_in_column_order


@triton.jit
def _plane(q, J: tl.constexpr, dtype: tl.constexpr):
    """Nibble J of each word (uint32) as the float OFF + q in `dtype` (OFF: 128 for bf16, 1024
    for fp16, 0 for fp32), exact."""
    nib = (q >> (4 * J)) & 0xF
    if dtype == tl.bfloat16:
        return (nib | 0x4300).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    elif dtype == tl.float16:
        return (nib | 0x6400).to(tl.uint16).to(tl.float16, bitcast=True)
    else:
        return nib.to(tl.float32)


@triton.jit
def _x_plane(x_ptr, offs_m, m_mask, ws, w_mask, stride_xm, J: tl.constexpr):
    """x's columns 8 ws + J for the tile's rows, transposed: [W, BLOCK_M]."""
    ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + (8 * ws + J)[:, None]
    return tl.load(ptrs, mask=w_mask[:, None] & m_mask[None, :], other=0.0)


@triton.jit
def _w4a16_gemm_kernel(
    x_ptr,  # [M, K_in]
    qw_ptr,  # int32 [N, K / 8]
    s_ptr,  # [N, G]
    z_ptr,  # uint8 [N, G]
    out_ptr,  # [M, N] (SPLIT == 1) or fp32 [SPLIT, M, N], the partial sums
    M,
    N,
    NUM_WORDS,
    STEPS_PER_SPLIT,  # steps of BLOCK_W words each split walks
    stride_xm,
    stride_qn,
    stride_sn,
    stride_zn,
    stride_om,
    stride_os,  # between splits' partial sums
    SPLIT,  # programs splitting K
    GROUP: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_W: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    split, offs_n, offs_m, n_mask, m_mask, rows = program_tile(M, N, SPLIT, BLOCK_M, BLOCK_N)
    dtype: tl.constexpr = x_ptr.dtype.element_ty
    # OFF + q for a nibble q (kernels' _plane): taken off with the zero point
    OFF: tl.constexpr = 128.0 if dtype == tl.bfloat16 else (1024.0 if dtype == tl.float16 else 0.0)
    FOLD: tl.constexpr = GROUP >= 8 * BLOCK_W  # a step in one group: scale its sums
    offs_w = tl.arange(0, BLOCK_W)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    w_start = split * STEPS_PER_SPLIT * BLOCK_W
    w_end = tl.minimum(w_start + STEPS_PER_SPLIT * BLOCK_W, NUM_WORDS)
    for w0 in range(w_start, w_end, BLOCK_W):
        ws = w0 + offs_w
        w_mask = ws < NUM_WORDS
        q = tl.load(qw_ptr + rows[:, None] * stride_qn + ws[None, :], mask=w_mask[None, :], other=0)
        q = q.to(tl.uint32, bitcast=True)
        if FOLD:
            g = w0 // (GROUP // 8)
            s = tl.load(s_ptr + rows * stride_sn + g).to(tl.float32)
            z = tl.load(z_ptr + rows * stride_zn + g).to(tl.float32)
            # the words' nibbles in column order, one product for the step: 8 products of
            # K = BLOCK_W, one per nibble plane, each staging its x plane for the MMA behind
            # a barrier, took 7-22% longer at 5 to 32 rows on an H200
            # (loadtest/results/gpu_w4a16_join_h200_run1.json)
            w = words_in_column_order(
                _plane(q, 0, dtype), _plane(q, 1, dtype), _plane(q, 2, dtype),
                _plane(q, 3, dtype), _plane(q, 4, dtype), _plane(q, 5, dtype),
                _plane(q, 6, dtype), _plane(q, 7, dtype), BLOCK_N, BLOCK_W,
            )  # fmt: skip
            cols = w0 * 8 + tl.arange(0, 8 * BLOCK_W)
            x_ptrs = x_ptr + offs_m.to(tl.int64)[None, :] * stride_xm + cols[:, None]
            xt = tl.load(x_ptrs, mask=(cols < NUM_WORDS * 8)[:, None] & m_mask[None, :], other=0.0)
            part = tl.dot(w, xt, input_precision=PRECISION)
            x_sum = tl.sum(xt.to(tl.float32), axis=0)
            acc += s[:, None] * (part - (OFF + z)[:, None] * x_sum[None, :])
        else:
            g = (ws // (GROUP // 8))[None, :]
            s = tl.load(s_ptr + rows[:, None] * stride_sn + g, mask=w_mask[None, :], other=0.0)
            z = tl.load(z_ptr + rows[:, None] * stride_zn + g, mask=w_mask[None, :], other=0)
            s = s.to(tl.float32)
            z = z.to(tl.float32)
            for j in tl.static_range(8):
                xj = _x_plane(x_ptr, offs_m, m_mask, ws, w_mask, stride_xm, j)
                nib = ((q >> (4 * j)) & 0xF).to(tl.float32)
                wj = ((nib - z) * s).to(dtype)
                acc = tl.dot(wj, xj, acc, input_precision=PRECISION)
    store_tile(out_ptr, acc, split, offs_n, offs_m, n_mask, m_mask, stride_om, stride_os)


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int = 128,
    split: int | None = None,
    num_warps: int = 4,
    num_stages: int = 2,
) -> torch.Tensor:
    """x @ w.T, w in the int4 layout of kernels/w4a16.py; returns out.

    x: [m, k_in] (any row stride), fp32/fp16/bf16. qweight, scales, zeros, perm: the layout
    (contiguous last dimensions, any row strides). out (optional, written): [m, n] of x's
    dtype, contiguous rows of any stride.
    block_m: the tile of x's rows (None: 16 up to 16 rows, 32 up to 32, else 64); block_n: of
    w's rows (None: `default_block_n`), both powers of two of at least 16; block_k: weight
    columns a step (block_k / 8 words, a power of two of at least 128); split: programs
    splitting K (a power of two; None: kernels/split_k's `default_split`). The defaults (4
    warps, 2 stages, block_k 128) were the best of 16 launches summed over Llama-3.1-8B's
    four projections at 5, 8, 16 and 32 rows on an H200
    (loadtest/results/gpu_w4a16_join_h200_run1.json), and of 12 at 48 and 64 rows
    (gpu_w4a16_bigm_h200_run1.json).
    """
    op = "w4a16_gemm"
    m, n, k = check_w4(op, x, qweight, scales, zeros, group_size, perm)
    # one tile of x's rows where it fits 64: every tile unpacks the words again. On an H200
    # at 20 to 32 rows, the four projections: 204-218 µs against 260-272 for two tiles of 16
    # (loadtest/results/gpu_m32_h200_run1.json, the kernel before the joined planes); at 48
    # and 64 rows 231.7 and 239.3 with tiles of 64 against 288.7 and 295.3 with two of 32
    # (gpu_w4a16_bigm_h200_run1.json)
    if block_m is None:
        block_m = 16 if m <= 16 else (32 if m <= 32 else 64)
    if out is None:
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    check_tensor(op, "out", out, shape=(m, n), dims="[m, n]", dtypes=(x.dtype,), device=x.device)
    check_tile(op, "block_m", block_m)
    if block_n is not None:
        check_tile(op, "block_n", block_n)
    if block_k < 128 or block_k & (block_k - 1):  # K = block_k / 8 a plane, as tl.dot needs
        raise ValueError(f"{op}: block_k must be a power of two of at least 128, got {block_k}")
    check_launch(op, num_warps, num_stages)
    if m == 0 or n == 0:
        return out
    if perm is not None:  # act-order: x's columns in the weight's order, once (gather_cols.py)
        x = gather_columns(x, perm)
    words, block_w = k // PACK, block_k // PACK
    split, per_split = plan(op, triton.cdiv(words, block_w), split)
    if block_n is None:
        block_n = default_block_n(m, n, split, x.device)
    target = workspace(out, split)
    pdl = pdl_launch(x.device)
    _w4a16_gemm_kernel[(triton.cdiv(m, block_m), triton.cdiv(n, block_n) * split)](
        x,
        qweight,
        scales,
        zeros,
        target,
        m,
        n,
        words,
        per_split,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        zeros.stride(0),
        target.stride(-2),
        target.stride(0) if split > 1 else 0,
        split,
        GROUP=group_size,
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_W=block_w,
        num_warps=num_warps,
        num_stages=num_stages,
        **pdl,
    )
    sum_splits(target, out, pdl)
    return out


def default_block_n(m: int, n: int, split: int, device: torch.device) -> int:
    """Weight rows a program, by the rows m of x. Up to 16: 128, or 64 where tiles of 128
    would give fewer than two programs an SM (Llama-3.1-8B's o and down, N = 4,096 over 8
    splits: 256 programs on 132 SMs); 17 to 32 (a tile of 32 rows of x): 64; past 32 (a tile
    of 64): 128. On an H200, the four projections (loadtest/results/gpu_w4a16_join_h200_run1.json
    and gpu_w4a16_bigm_h200_run1.json): at 8 rows 131.5 µs against 134.5 with 128 everywhere
    and 145.6 with 64; at 32 rows 169.3 against 182.0 with 128; at 64 rows 239.3 against
    288.0 with 64."""
    if m > 32:
        return 128
    if m > 16 or triton.cdiv(n, 128) * split < 2 * sm_count(device):
        return 64
    return 128
