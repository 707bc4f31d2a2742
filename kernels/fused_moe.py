"""Fused mixture-of-experts MLP: every token's top-k experts, SiLU-gated, weighted and summed,
in two grouped GEMM launches for the whole batch.

1. `moe_align` (kernels/moe_align.py) groups the (token, slot) pairs by expert and pads each
   expert's run to a multiple of BLOCK_M, so that every BLOCK_M rows of the sorted order
   belong to one expert (`expert_ids[block]`). Padding rows hold the index `tokens * top_k`
   (past every real pair). Shapes depend only on (tokens, top_k, experts, BLOCK_M), never on
   the routing, and nothing is read back to the host: the step stays capturable in a CUDA
   graph.
2. gate_up launch: rows of x (pair // top_k) times the expert's gate and up rows, both in one
   program (two accumulators), silu(gate) * up written per pair: [pairs, I].
3. down launch: those rows times the expert's down weight, scaled by the pair's routing weight:
   [pairs, hidden]; the top_k rows of a token are then summed (a third, small launch).

Grid of each launch: (max_blocks * cdiv(N, BLOCK_N),); programs whose block lies past the padded
total (read from the device) return at once, so experts with no tokens cost nothing.

One token (a batch-1 decode step) skips step 1: its top_k experts are distinct, so block p is
pair p alone (`DIRECT`), read straight from topk_ids.

fp8 experts (`w13_scale`, `w2_scale`: DeepSeek's and Qwen's FP8 releases): weights e4m3 with
one fp32 scale per 128x128 block, [experts, rows' blocks, columns' blocks]; a tile (BLOCK_N and
BLOCK_K dividing 128) lies in one block, so each step's product of x with the widened tile is
scaled once before it is added. Gate's and up's rows have their own blocks (the checkpoint
holds them as two tensors): up's start at block row ceil(I / 128). Or one fp32 scale per
weight row (compressed-tensors' per-channel fp8, and --quantization fp8), [experts, rows]:
the finished sums are scaled. Activations stay 16-bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
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
)
from kernels.moe_align import moe_align
from kernels.moe_gemv import moe_gemv
from kernels.pdl import pdl_launch, pdl_prologue


@triton.jit
def _fused_moe_kernel(
    a_ptr,  # [rows of A, K]
    b_ptr,  # [experts, N (x2 with SILU_MUL), K]
    c_ptr,  # [pairs, N]
    weights_ptr,  # [pairs] fp32 routing weights (MUL_WEIGHT)
    sorted_ids_ptr,  # [max_padded] int32: pair index, or num_pairs for padding
    expert_ids_ptr,  # [max_blocks] int32
    num_post_padded_ptr,  # [1] int32
    num_pairs,
    N,
    K,
    stride_am,
    stride_be,
    stride_bn,
    stride_cm,
    A_ROW_DIV: tl.constexpr,  # A's row of a pair: pair // A_ROW_DIV (top_k for x, 1 after)
    SILU_MUL: tl.constexpr,  # B holds [gate; up] rows: write silu(x.gate) * (x.up)
    MUL_WEIGHT: tl.constexpr,
    PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DIRECT: tl.constexpr,  # one token: block p is pair p alone, expert_ids_ptr its top-k ids
    PDL: tl.constexpr,
    s_ptr=None,  # fp8 B: fp32 [experts, row blocks, column blocks] scales (BLOCK_SCALES)
    stride_se=0,
    stride_sn=0,
    UP_BLOCK_ROW=0,  # SILU_MUL: the block row where up's scales start
    BLOCK_SCALES: tl.constexpr = False,
    ROW_SCALES: tl.constexpr = False,  # fp8 B: fp32 [experts, N (x2 with SILU_MUL)] scales
):
    pdl_prologue(PDL)
    pid = tl.program_id(0)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_pid_n
    pid_n = pid % num_pid_n
    if DIRECT:
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = tl.arange(0, BLOCK_M)
        pairs = pid_m + 0 * offs_m  # row 0 is the pair; the others are masked
        m_mask = offs_m == 0
    else:
        if pid_m * BLOCK_M >= tl.load(num_post_padded_ptr):
            return
        expert = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        pairs = tl.load(sorted_ids_ptr + offs_m)
        m_mask = pairs < num_pairs
    a_rows = (pairs // A_ROW_DIV).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    b_base = b_ptr + expert * stride_be + offs_n.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    if BLOCK_SCALES:  # this tile's row of blocks (BLOCK_N divides 128)
        s_row = s_ptr + expert * stride_se + ((pid_n * BLOCK_N) // 128) * stride_sn
        s_row_up = s_row + UP_BLOCK_ROW * stride_sn
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        a = tl.load(
            a_ptr + a_rows[:, None] * stride_am + offs_k[None, :],
            mask=m_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        b_mask = k_mask[:, None] & n_mask[None, :]
        b = tl.load(b_base + offs_k[:, None], mask=b_mask, other=0.0)  # [BLOCK_K, BLOCK_N]
        if BLOCK_SCALES or ROW_SCALES:  # e4m3, widened exactly
            b = b.to(a.dtype)
        if BLOCK_SCALES:  # the block's scale once for the step's product (rows': after the loop)
            s = tl.load(s_row + k0 // 128)
            acc += tl.dot(a, b, input_precision=PRECISION) * s
        else:
            acc = tl.dot(a, b, acc, input_precision=PRECISION)
        if SILU_MUL:
            up = tl.load(b_base + N * stride_bn + offs_k[:, None], mask=b_mask, other=0.0)
            if BLOCK_SCALES or ROW_SCALES:
                up = up.to(a.dtype)
            if BLOCK_SCALES:
                s_up = tl.load(s_row_up + k0 // 128)
                acc_up += tl.dot(a, up, input_precision=PRECISION) * s_up
            else:
                acc_up = tl.dot(a, up, acc_up, input_precision=PRECISION)
    if ROW_SCALES:  # a row's scale multiplies its finished sums
        s_rows = s_ptr + expert * stride_se + offs_n
        acc *= tl.load(s_rows, mask=n_mask, other=0.0)[None, :]
        if SILU_MUL:
            acc_up *= tl.load(s_rows + N, mask=n_mask, other=0.0)[None, :]
    if SILU_MUL:
        acc = acc / (1.0 + tl.exp(-acc)) * acc_up
    if MUL_WEIGHT:
        w = tl.load(weights_ptr + pairs, mask=m_mask, other=0.0)
        acc = acc * w[:, None]
    c = c_ptr + pairs.to(tl.int64)[:, None] * stride_cm + offs_n[None, :]
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_mask[:, None] & n_mask[None, :])


@triton.jit
def _moe_sum_kernel(
    in_ptr,
    add_ptr,
    out_ptr,
    hidden,
    stride_add,
    TOP_K: tl.constexpr,
    HAS_ADD: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """out[t] = sum over j of in[t * TOP_K + j], in fp32, rounded once (as torch.sum); with
    HAS_ADD, that sum + add[t], rounded again (as torch's `out + add` would round it)."""
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < hidden
    dtype = out_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for j in tl.static_range(TOP_K):
        row = in_ptr + (tok * TOP_K + j) * hidden
        acc += tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    total = acc.to(dtype)
    if HAS_ADD:
        extra = tl.load(add_ptr + tok * stride_add + offs, mask=mask, other=0.0)
        total = (total.to(tl.float32) + extra.to(tl.float32)).to(dtype)
    tl.store(out_ptr + tok * hidden + offs, total, mask=mask)


_SUM_BLOCK = 1024  # hidden elements per program of the top-k sum


def choose_tiles(num_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, gate/up's BLOCK_N, down's BLOCK_N, BLOCK_K) from the tokens per expert.
    Few (decode): 16 rows, so padding is cheap, and deep tiles, so the few experts in use are
    read by many programs at once (the step is bound by reading their weights); gate/up 32
    columns wide, down 64. Many (prefill): 64 x 64.

    Down's width is from a sweep of both launches' tiles on an H100 (2026-11-27,
    `loadtest/results/gpu_moe_tiles_h100_run1.json`, microseconds a launch, 32 wide against
    64): DeepSeek-V2-Lite at 4 tokens 50.9 against 41.6, Qwen3-30B-A3B 32.9 against 32.5; at
    one token (its experts read from L2 there) 8.47 against 8.34 and 6.42 against 6.12.
    Gate/up gained nothing measurable from other widths."""
    per_expert = num_pairs / num_experts
    if per_expert <= 16:
        return 16, 32, 64, 128
    return (32, 64, 64, 64) if per_expert <= 48 else (64, 64, 64, 64)


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    block_m: int | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int = 4,
    num_stages: int = 3,
    path: str = "auto",
    reduce: bool = True,
    add: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """sum over j of topk_weights[t, j] * down_e(silu(gate_e(x[t])) * up_e(x[t])), e =
    topk_ids[t, j]; returns [tokens, hidden] in x's dtype.

    x: [tokens, hidden]; w13: [experts, 2 * I, hidden] (rows [0, I) gate, [I, 2I) up);
    w2: [experts, hidden, I]; topk_weights: [tokens, top_k] fp32; topk_ids: [tokens, top_k]
    int32/int64 in [0, experts). block_m/block_n/block_k: the tiles (powers of two >= 16;
    block_n is both launches'); None takes `choose_tiles`'s. path: "grouped" (the grouped
    GEMM), "gemv" (kernels/moe_gemv; the tiles do not apply) or "auto", which is the grouped
    GEMM: on an H200, Qwen3-30B-A3B's batch-1 step spent 2.18 ms in moe_gemv's two launches
    with its default configuration, where the grouped path had taken 1.74 ms (align and sum
    included) on an H100.
    reduce=False: the grouped path returns each token's top_k weighted expert outputs
    unsummed, [tokens, top_k, hidden], for a consumer that sums them itself
    (kernels/rmsnorm.py: one launch fewer); the gemv path sums regardless.
    add: [tokens, hidden] in x's dtype (any row stride), added to the sum in the sum's own
    launch and rounded as `fused_moe(...) + add` would be (a shared expert's output: one
    torch add fewer a layer); not with reduce=False.
    w13_scale, w2_scale: fp8 experts (w13 and w2 float8_e4m3fn), fp32 scales per 128x128
    block: [experts, 2 * ceil(I / 128), ceil(hidden / 128)] (gate's block rows, then up's)
    and [experts, ceil(hidden / 128), ceil(I / 128)], tiles dividing 128; or per row:
    [experts, 2 * I] and [experts, hidden]. The grouped path only.
    """
    op = "fused_moe"
    check_tensor(op, "x", x, shape=(None, None), dims="[tokens, hidden]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    tokens, hidden = x.shape
    fp8 = w13_scale is not None or w2_scale is not None
    w_dtypes = (torch.float8_e4m3fn,) if fp8 else (x.dtype,)
    check_tensor(
        op,
        "w13",
        w13,
        shape=(None, None, hidden),
        dims="[experts, 2 * I, hidden]",
        dtypes=w_dtypes,
        device=x.device,
    )
    num_experts, two_i, _ = w13.shape
    if two_i % 2:
        raise ValueError(f"{op}: w13's rows must be even (gate, up), got {two_i}")
    inter = two_i // 2
    check_tensor(
        op,
        "w2",
        w2,
        shape=(num_experts, hidden, inter),
        dims="[experts, hidden, I]",
        dtypes=w_dtypes,
        device=x.device,
    )
    rows = fp8 and w13_scale is not None and w13_scale.dim() == 2
    if fp8:
        _check_scales(op, w13_scale, w2_scale, num_experts, inter, hidden, x.device, rows)
    check_tensor(
        op,
        "topk_ids",
        topk_ids,
        shape=(tokens, None),
        dims="[tokens, top_k]",
        dtypes=INDEX_DTYPES,
        device=x.device,
    )
    top_k = topk_ids.shape[1]
    check_tensor(
        op,
        "topk_weights",
        topk_weights,
        shape=(tokens, top_k),
        dims="[tokens, top_k]",
        dtypes=(torch.float32,),
        device=x.device,
    )
    auto_m, auto_n, auto_down_n, auto_k = choose_tiles(tokens * top_k, num_experts)
    bm, bn, bk = block_m or auto_m, block_n or auto_n, block_k or auto_k
    down_bn = block_n or auto_down_n
    for name, size in (("block_m", bm), ("block_n", bn), ("block_k", bk)):
        check_tile(op, name, size)
    check_launch(op, num_warps, num_stages)
    if x.stride(0) != hidden or w13.stride(1) != hidden or w2.stride(1) != inter:
        raise ValueError(f"{op}: x, w13 and w2 must have contiguous rows")
    if path not in ("auto", "grouped", "gemv"):
        raise ValueError(f"{op}: path must be 'auto', 'grouped' or 'gemv', got {path!r}")
    if fp8:
        if path == "gemv":
            raise ValueError(f"{op}: fp8 experts take the grouped path, not 'gemv'")
        tiles = () if rows else (("block_n", bn), ("down block_n", down_bn), ("block_k", bk))
        for name, size in tiles:
            if 128 % size:
                raise ValueError(f"{op}: with fp8 block scales {name} must divide 128, got {size}")
    if add is not None:
        if not reduce:
            raise ValueError(f"{op}: add needs reduce=True (it is added to the sum)")
        check_tensor(
            op, "add", add, shape=(tokens, hidden), dims="[tokens, hidden]", dtypes=(x.dtype,),
            device=x.device,
        )  # fmt: skip
    if path == "gemv" and tokens > 0:
        summed = moe_gemv(x, w13, w2, topk_weights, topk_ids)
        return summed if add is None else summed + add
    if tokens == 0:
        return torch.empty((0, hidden), dtype=x.dtype, device=x.device)
    num_pairs = tokens * top_k
    # One token (batch-1 decode): its top_k experts are distinct, so block p is pair p and
    # needs no sorting; the align launch (a chain of dependent loads and stores in one
    # program, several microseconds a layer) is skipped.
    direct = tokens == 1
    if direct:
        flat_ids = topk_ids.reshape(-1)
        sorted_ids, expert_ids, num_post_padded = flat_ids, flat_ids, flat_ids  # only ids read
    else:
        sorted_ids, expert_ids, num_post_padded = moe_align(topk_ids, num_experts, bm)
    act = torch.empty((num_pairs, inter), dtype=x.dtype, device=x.device)
    per_pair = torch.empty((num_pairs, hidden), dtype=x.dtype, device=x.device)
    weights = topk_weights.contiguous().view(-1)
    common = dict(
        PRECISION=dot_precision(x.dtype),
        BLOCK_M=bm,
        BLOCK_K=bk,
        DIRECT=direct,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    blocks = expert_ids.shape[0]
    # gate_up with silu_mul: x [tokens, hidden] -> act [pairs, I]
    _fused_moe_kernel[(blocks * triton.cdiv(inter, bn),)](
        x,
        w13,
        act,
        weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        num_pairs,
        inter,
        hidden,
        x.stride(0),
        w13.stride(0),
        w13.stride(1),
        act.stride(0),
        A_ROW_DIV=top_k,
        SILU_MUL=True,
        MUL_WEIGHT=False,
        BLOCK_N=bn,
        **common,
        **pdl_launch(x.device),
        **_scale_args(w13_scale, up_block_row=-(-inter // 128), rows=rows),
    )
    # down, weighted: act [pairs, I] -> per_pair [pairs, hidden]
    _fused_moe_kernel[(blocks * triton.cdiv(hidden, down_bn),)](
        act,
        w2,
        per_pair,
        weights,
        sorted_ids,
        expert_ids,
        num_post_padded,
        num_pairs,
        hidden,
        inter,
        act.stride(0),
        w2.stride(0),
        w2.stride(1),
        per_pair.stride(0),
        A_ROW_DIV=1,
        SILU_MUL=False,
        MUL_WEIGHT=True,
        BLOCK_N=down_bn,
        **common,
        **pdl_launch(act.device),
        **_scale_args(w2_scale, up_block_row=0, rows=rows),
    )
    if not reduce:
        return per_pair.view(tokens, top_k, hidden)
    out = torch.empty((tokens, hidden), dtype=x.dtype, device=x.device)
    # the top_k rows of each token summed: one small launch (torch's strided reduction takes
    # about twice as long at decode sizes)
    _moe_sum_kernel[(tokens, triton.cdiv(hidden, _SUM_BLOCK))](
        per_pair,
        per_pair if add is None else add,  # never read without HAS_ADD
        out,
        hidden,
        0 if add is None else add.stride(0),
        TOP_K=top_k,
        HAS_ADD=add is not None,
        BLOCK=_SUM_BLOCK,
        num_warps=4,
        **pdl_launch(per_pair.device),
    )
    return out


def _check_scales(
    op: str,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    experts: int,
    inter: int,
    hidden: int,
    device: torch.device,
    rows: bool,
) -> None:
    """fp8 experts' scales: per 128x128 block, or per weight row (`rows`)."""
    if w13_scale is None or w2_scale is None:
        raise ValueError(f"{op}: fp8 experts need both w13_scale and w2_scale")
    i_blocks, h_blocks = -(-inter // 128), -(-hidden // 128)
    shapes = (
        (((experts, 2 * inter), "[experts, 2 * I]"), ((experts, hidden), "[experts, hidden]"))
        if rows
        else (
            ((experts, 2 * i_blocks, h_blocks), "[experts, 2 * ceil(I / 128), ceil(hidden / 128)]"),
            ((experts, h_blocks, i_blocks), "[experts, ceil(hidden / 128), ceil(I / 128)]"),
        )
    )
    scales = zip(("w13_scale", "w2_scale"), (w13_scale, w2_scale), shapes, strict=True)
    for name, t, (shape, dims) in scales:
        check_tensor(op, name, t, shape=shape, dims=dims, dtypes=(torch.float32,), device=device)
        if t.stride(-1) != 1:
            raise ValueError(f"{op}: {name} must have contiguous rows, got strides {t.stride()}")


def _scale_args(
    scale: torch.Tensor | None, up_block_row: int, rows: bool = False
) -> dict[str, object]:
    """A launch's scale arguments: per 128x128 block, or per weight row (`rows`); none for
    16-bit experts."""
    if scale is None:
        return {}
    if rows:
        return dict(s_ptr=scale, stride_se=scale.stride(0), ROW_SCALES=True)
    return dict(
        s_ptr=scale, stride_se=scale.stride(0), stride_sn=scale.stride(1),
        UP_BLOCK_ROW=up_block_row, BLOCK_SCALES=True,
    )  # fmt: skip


def quantize_experts(
    w13: torch.Tensor, w2: torch.Tensor, rows: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float experts w13 [experts, 2I, hidden] (gate's rows, then up's) and w2 [experts,
    hidden, I] in e4m3 with the scales `fused_moe` reads: (q13, q2, s13, s2). Per 128x128
    block, gate's and up's blocks apart as a checkpoint's two tensors hold them, or with
    `rows` one per row, [experts, rows]."""
    from kernels.fp8_weights import quantize_blocks, quantize_rows

    if rows:
        r13, r2 = [quantize_rows(w) for w in w13], [quantize_rows(w) for w in w2]
        return (
            torch.stack([q for q, _ in r13]),
            torch.stack([q for q, _ in r2]),
            torch.stack([s[:, 0] for _, s in r13]),
            torch.stack([s[:, 0] for _, s in r2]),
        )
    inter = w13.shape[1] // 2
    gate_up = [(quantize_blocks(w[:inter]), quantize_blocks(w[inter:])) for w in w13]
    down = [quantize_blocks(w) for w in w2]
    return (
        torch.stack([torch.cat([g[0], u[0]]) for g, u in gate_up]),
        torch.stack([q for q, _ in down]),
        torch.stack([torch.cat([g[1], u[1]]) for g, u in gate_up]),
        torch.stack([s for _, s in down]),
    )


def dequantize_experts(w: torch.Tensor, scale: torch.Tensor, up_rows: int = 0) -> torch.Tensor:
    """fp8 experts [experts, rows, cols] with 128x128 block scales, in fp32. up_rows: w13's
    I, whose up rows (from row I) have block rows of their own from ceil(I / 128). Scales
    [experts, rows] are per row."""
    from kernels.fp8_weights import BLOCK, dequantize

    if scale.dim() == 2:
        return torch.stack([dequantize(q, s[:, None]) for q, s in zip(w, scale, strict=True)])
    if up_rows:
        first = -(-up_rows // BLOCK)
        gate = dequantize_experts(w[:, :up_rows], scale[:, :first])
        up = dequantize_experts(w[:, up_rows:], scale[:, first:])
        return torch.cat([gate, up], dim=1)
    return torch.stack([dequantize(q, s, BLOCK) for q, s in zip(w, scale, strict=True)])


def fused_moe_ref(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of `fused_moe` (and the CPU path): a loop over the experts that have
    tokens, each one's pairs gathered, computed and scattered back. Syncs the host (it asks
    which experts are used): not for CUDA graphs. fp8 experts with their block scales are
    dequantized first."""
    if (w13_scale is None) != (w2_scale is None):
        raise ValueError("fused_moe_ref: fp8 experts need both w13_scale and w2_scale")
    if w13_scale is not None and w2_scale is not None:
        w13 = dequantize_experts(w13, w13_scale, up_rows=w13.shape[1] // 2)
        w2 = dequantize_experts(w2, w2_scale)
    tokens, top_k = topk_ids.shape
    inter = w13.shape[1] // 2
    out = torch.zeros((tokens, x.shape[1]), dtype=torch.float32, device=x.device)
    flat = topk_ids.reshape(-1)
    for expert in torch.unique(flat).tolist():
        pairs = (flat == expert).nonzero().squeeze(1)
        rows = pairs // top_k
        gate_up = x[rows].float() @ w13[expert].float().T
        act = (F.silu(gate_up[:, :inter]) * gate_up[:, inter:]).to(x.dtype).float()
        down = act @ w2[expert].float().T
        w = topk_weights.reshape(-1)[pairs].float()
        out.index_add_(0, rows, (down * w[:, None]).to(x.dtype).float())
    return out.to(x.dtype)
