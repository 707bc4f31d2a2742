"""The launcher calls tests/kernels/native_compile.py compiles for sm_90: every kernel of
kernels/, through the constexpr branches a GPU compiles (decode and prefill shapes, 16-bit
dtypes, PDL on and off, fp8 KV pools, the optional fusions).

Tensors are empty CPU tensors: nothing is launched, so only shapes, dtypes and strides matter.
Shapes are small but of the models' proportions (head dims, ranks, group sizes), since the
compiler specialises on divisibility by 16 and on the constexpr tiles derived from them.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch

from kernels.argmax import finite_argmax_rows
from kernels.bitmask import apply_token_bitmask
from kernels.decode_attention import DecodeWorkspace, decode_attention
from kernels.extend_attention import extend_attention
from kernels.flat_slots import flat_slots
from kernels.fp8_act_quant import quantize_act
from kernels.fp8_block_gemm import fp8_block_gemm
from kernels.fp8_gemm import fp8_gemm
from kernels.fp8_gemv import fp8_gemv
from kernels.fp8_weights import BLOCK, FP8
from kernels.fused_moe import fused_moe
from kernels.gated_act import gelu_tanh_mul, silu_mul
from kernels.gemv import gemv
from kernels.gguf_blocks import LAYOUTS, row_bytes
from kernels.gguf_dequant import gguf_dequantize
from kernels.gguf_gemv import gguf_gemv
from kernels.head_gemv import OUTPUT_TILES, QUERY_TILES, head_gemv
from kernels.mla_decode import mla_decode
from kernels.mla_extend import mla_extend
from kernels.mla_prep import mla_prep
from kernels.moe_align import moe_align
from kernels.moe_topk import moe_topk
from kernels.rmsnorm import rmsnorm
from kernels.rotary import KVStore, QKNorm, apply_rotary
from kernels.store_kv import store_kv
from kernels.w4a16_dequant import w4a16_dequantize
from kernels.w4a16_gemm import w4a16_gemm
from kernels.w4a16_gemv import w4a16_gemv
from kernels.w4a16_mma import w4a16_mma
from kernels.w4a16_mma_dequant import w4a16_mma_dequantize
from tests.kernels.native_compile import Case

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E5M2, E4M3 = torch.float8_e5m2, torch.float8_e4m3fn


def _t(*shape: int, dtype: torch.dtype = BF16) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype)


def _ints(n: int, dtype: torch.dtype = torch.int64) -> torch.Tensor:
    return torch.zeros(n, dtype=dtype)


# -- dense layers ---------------------------------------------------------------------------


def _gemv(dtype: torch.dtype, m: int) -> None:
    gemv(_t(m, 4096, dtype=dtype), _t(1024, 4096, dtype=dtype))


def _fp8_gemv(
    block_scales: bool, packed: bool = False, m: int = 2, dtype: torch.dtype = BF16
) -> None:
    n, k = 1024, 4096
    scale = _t(n // BLOCK, k // BLOCK, dtype=FP32) if block_scales else _t(n, 1, dtype=FP32)
    x, w = _t(m, k, dtype=dtype), _t(n, k, dtype=FP8)
    if packed:  # kernels/fp8_gemv_packed
        fp8_gemv(x, w, scale, block_scales=block_scales, block_k=1024, num_warps=2, packed=True)
    else:
        fp8_gemv(x, w, scale, block_scales=block_scales)


def _quantize_act(group: int, static: bool) -> None:
    quantize_act(_t(16, 4096), group=group, static_scale=_t(1, dtype=FP32) if static else None)


def _fp8_block_gemm(out_dtype: torch.dtype) -> None:
    m, n, k = 64, 1024, 4096
    a, a_scale = _t(m, k, dtype=FP8), _t(m, k // BLOCK, dtype=FP32)
    w, w_scale = _t(n, k, dtype=FP8), _t(n // BLOCK, k // BLOCK, dtype=FP32)
    fp8_block_gemm(a, a_scale, w, w_scale, out_dtype=out_dtype)


def _fp8_gemm(dtype: torch.dtype, blocks: bool) -> None:
    n, k = 1024, 4096  # a decode batch of 8 (K split 8 ways)
    f32 = torch.float32
    scale = _t(-(-n // BLOCK), k // BLOCK, dtype=f32) if blocks else _t(n, 1, dtype=f32)
    fp8_gemm(_t(8, k, dtype=dtype), _t(n, k, dtype=FP8), scale, block_scales=blocks)


def _w4a16(gemm: bool, dtype: torch.dtype, group: int, act_order: bool, m: int) -> None:
    n, k = 1024, 4096
    qweight, zeros = _t(n, k // 8, dtype=torch.int32), _t(n, k // group, dtype=torch.uint8)
    scales = _t(n, k // group, dtype=FP16)  # as AWQ and GPTQ checkpoints keep them
    perm = _ints(k, torch.int32) if act_order else None
    launch = w4a16_gemm if gemm else w4a16_gemv
    launch(_t(m, k, dtype=dtype), qweight, scales, zeros, group_size=group, perm=perm)


def _w4a16_mma(
    dtype: torch.dtype,
    group: int,
    m: int,
    split: int,
    ahead: int | None = None,
    zsub: bool | None = None,
    mins: bool = False,
    scales_like_x: bool = False,
) -> None:
    n, k = 1024, 4096
    qmma, zeros = (
        _t(n // 16, k // 64, 32, 4, dtype=torch.int32),
        _t(n, k // group, dtype=torch.uint8),
    )
    # scales (and mins) of x's type: groups of 32 with mins take the scales inside A
    scales = _t(n, k // group, dtype=dtype if scales_like_x else FP16)
    x = _t(m, k, dtype=dtype)
    w4a16_mma(x, qmma, scales, None if mins else zeros, group_size=group, split=split,
              ahead=ahead, zsub=zsub, mins=scales if mins else None)  # fmt: skip


def _w4a16_mma_dequant(dtype: torch.dtype, group: int, mins: bool = False) -> None:
    n, k = 1024, 4096
    qmma = _t(n // 16, k // 64, 32, 4, dtype=torch.int32)
    scales, zeros = _t(n, k // group, dtype=FP16), _t(n, k // group, dtype=torch.uint8)
    w4a16_mma_dequantize(qmma, scales, None if mins else zeros, group_size=group, dtype=dtype,
                         mins=scales if mins else None)  # fmt: skip


def _w4a16_dequant(dtype: torch.dtype, act_order: bool) -> None:
    n, k, group = 1024, 4096, 128
    qweight, zeros = _t(n, k // 8, dtype=torch.int32), _t(n, k // group, dtype=torch.uint8)
    perm = _ints(k, torch.int32) if act_order else None
    w4a16_dequantize(
        qweight, _t(n, k // group, dtype=FP16), zeros, group_size=group, perm=perm, dtype=dtype
    )


def _gguf(op: str, qtype: str, dtype: torch.dtype) -> None:
    n, k = 256, 4096
    blocks = _t(n, row_bytes(qtype, k), dtype=torch.uint8)
    if op == "gemv":
        gguf_gemv(_t(1, k, dtype=dtype), blocks, qtype=qtype)
    else:
        gguf_dequantize(blocks, qtype=qtype, k=k, dtype=dtype)


def _rmsnorm(dtype: torch.dtype, residual: bool, unit_offset: bool, rows: int = 0) -> None:
    x = _t(4, rows, 4096, dtype=dtype) if rows else _t(4, 4096, dtype=dtype)  # rows: summed
    res = _t(4, 4096, dtype=dtype) if residual else None
    rmsnorm(x, _t(4096, dtype=dtype), 1e-6, residual=res, unit_offset=unit_offset)


def _argmax() -> None:
    finite_argmax_rows(_t(1, 128256, dtype=FP32))  # Llama 3's vocabulary


def _act(gelu: bool, dtype: torch.dtype) -> None:
    (gelu_tanh_mul if gelu else silu_mul)(_t(4, 2 * 14336, dtype=dtype))


def _head_gemv(dtype: torch.dtype) -> None:
    heads, i, j = 16, 128, 512  # DeepSeek's absorbed q_nope @ W_UK, then attn @ W_UV^T
    bi, bj, warps = QUERY_TILES
    head_gemv(
        _t(2, heads, i, dtype=dtype), _t(heads, i, j, dtype=dtype), _t(2, heads, j, dtype=dtype),
        block_i=bi, block_j=bj, num_warps=warps,
    )  # fmt: skip
    bi, bj, warps = OUTPUT_TILES
    w_uv = _t(heads, i, j, dtype=dtype).transpose(1, 2)
    head_gemv(
        _t(2, heads, j, dtype=dtype), w_uv, _t(2, heads, i, dtype=dtype),
        block_i=bi, block_j=bj, num_warps=warps,
    )  # fmt: skip


def _bitmask(dtype: torch.dtype) -> None:
    vocab = 128256
    apply_token_bitmask(
        logits=_t(4, vocab, dtype=dtype), bitmask=_t(4, vocab // 32, dtype=torch.int32)
    )


# -- rotary and the KV pool -----------------------------------------------------------------


def _rotary(
    dtype: torch.dtype, rotary_dim: int, norm: bool, unit_offset: bool, store: bool
) -> None:
    n, heads, kv_heads, head_dim = 4, 32, 8, 128
    qkv = _t(n, heads + 2 * kv_heads, head_dim, dtype=dtype)  # views of one fused projection
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    w = _t(head_dim, dtype=dtype)
    kv_store = None
    if store:
        pool = (_t(64, kv_heads, head_dim, dtype=dtype), _t(64, kv_heads, head_dim, dtype=dtype))
        kv_store = KVStore(v, *pool, _ints(n))
    apply_rotary(
        q=q,
        k=k,
        positions=_ints(n),
        cos_sin_cache=_t(256, rotary_dim, dtype=FP32),
        norm=QKNorm(w, w, 1e-6, unit_offset) if norm else None,
        store=kv_store,
    )


def _store_kv(dtype: torch.dtype, pool: torch.dtype) -> None:
    n, kv_heads, head_dim = 4, 8, 128
    k, v = _t(n, kv_heads, head_dim, dtype=dtype), _t(n, kv_heads, head_dim, dtype=dtype)
    k_buffer, v_buffer = (
        _t(64, kv_heads, head_dim, dtype=pool),
        _t(64, kv_heads, head_dim, dtype=pool),
    )
    store_kv(k=k, v=v, k_buffer=k_buffer, v_buffer=v_buffer, out_cache_loc=_ints(n))


def _flat_slots(table_dtype: torch.dtype) -> None:
    bs = 4
    flat_slots(
        req_to_token=_t(8, 4096, dtype=table_dtype),
        req_rows=_ints(bs),
        indptr=_ints(bs + 1, torch.int32),
        max_len=4096,
        out=_ints(64, torch.int32),
    )


# -- attention ------------------------------------------------------------------------------


def _decode(
    dtype: torch.dtype,
    pool: torch.dtype | None = None,
    *,
    heads: int = 32,
    kv_heads: int = 8,
    head_dim: int = 128,
    num_stages: int = 2,
    splits: int = 16,
    window: int | None = None,
    softcap: float | None = None,
    kv_pack: int | None = None,
    early_k: bool = False,
    early_v: bool = False,
    lazy_rescale: bool = False,
) -> None:
    bs = 4
    ws = DecodeWorkspace.allocate(
        max_batch_size=bs, num_heads=heads, head_dim=head_dim, max_kv_splits=splits, device="cpu"
    )
    decode_attention(
        q=_t(bs, heads, head_dim, dtype=dtype),
        k_buffer=_t(256, kv_heads, head_dim, dtype=pool or dtype),
        v_buffer=_t(256, kv_heads, head_dim, dtype=pool or dtype),
        req_to_token=_t(bs + 1, 64, dtype=torch.int64),
        req_rows=_ints(bs),
        seq_lens=_ints(bs),
        num_kv_splits=_ints(bs, torch.int32),
        workspace=ws,
        sm_scale=head_dim**-0.5,
        num_stages=num_stages,
        window=window,
        softcap=softcap,
        kv_pack=kv_pack,
        early_k=early_k,
        early_v=early_v,
        lazy_rescale=lazy_rescale,
    )


def _extend(
    dtype: torch.dtype,
    pool: torch.dtype | None = None,
    *,
    max_extend_len: int = 512,
    head_dim: int = 128,
    window: int | None = None,
    softcap: float | None = None,
) -> None:
    bs, heads, kv_heads = 2, 32, 8
    extend_attention(
        q=_t(2 * max_extend_len, heads, head_dim, dtype=dtype),
        k_buffer=_t(4096, kv_heads, head_dim, dtype=pool or dtype),
        v_buffer=_t(4096, kv_heads, head_dim, dtype=pool or dtype),
        req_to_token=_t(bs + 1, 2048, dtype=torch.int64),
        req_rows=_ints(bs),
        prefix_lens=_ints(bs),
        extend_lens=_ints(bs),
        extend_starts=_ints(bs),
        max_extend_len=max_extend_len,
        sm_scale=head_dim**-0.5,
        window=window,
        softcap=softcap,
    )


_RANK, _ROPE = 512, 64  # DeepSeek-V2/V3's latent width and rotary part


def _mla_decode(dtype: torch.dtype, pool: torch.dtype | None = None, rank: int = _RANK) -> None:
    bs, heads = 4, 16
    ws = DecodeWorkspace.allocate(
        max_batch_size=bs, num_heads=heads, head_dim=rank, max_kv_splits=16, device="cpu"
    )
    mla_decode(
        q=_t(bs, heads, rank + _ROPE, dtype=dtype),
        buffer=_t(256, 1, rank + _ROPE, dtype=pool or dtype),
        rank=rank,
        req_to_token=_t(bs + 1, 64, dtype=torch.int64),
        req_rows=_ints(bs),
        seq_lens=_ints(bs),
        num_kv_splits=_ints(bs, torch.int32),
        workspace=ws,
        sm_scale=0.1,
    )


def _mla_extend(dtype: torch.dtype, pool: torch.dtype | None = None, rank: int = _RANK) -> None:
    bs, heads, tokens = 2, 16, 256
    mla_extend(
        q=_t(tokens, heads, rank + _ROPE, dtype=dtype),
        buffer=_t(4096, 1, rank + _ROPE, dtype=pool or dtype),
        rank=rank,
        req_to_token=_t(bs + 1, 2048, dtype=torch.int64),
        req_rows=_ints(bs),
        prefix_lens=_ints(bs),
        extend_lens=_ints(bs),
        extend_starts=_ints(bs),
        max_extend_len=tokens // bs,
        sm_scale=0.1,
    )


def _mla_prep(dtype: torch.dtype, interleave: bool, mscale: float) -> None:
    n, heads, nope = 4, 16, 128
    mla_prep(
        q=_t(n, heads, nope + _ROPE, dtype=dtype),
        kv=_t(n, _RANK + _ROPE, dtype=dtype),
        query=_t(n, heads, _RANK + _ROPE, dtype=dtype),
        buffer=_t(256, 1, _RANK + _ROPE, dtype=dtype),
        out_cache_loc=_ints(n),
        positions=_ints(n),
        cos_sin_cache=_t(4096, _ROPE, dtype=FP32),
        norm_weight=_t(_RANK, dtype=dtype),
        eps=1e-6,
        rank=_RANK,
        interleave=interleave,
        mscale=mscale,
    )


# -- mixture of experts ---------------------------------------------------------------------


def _moe_topk(
    dtype: torch.dtype,
    experts: int,
    scoring: str,
    renormalise: bool,
    top_k: int = 8,
    extra: int = 0,
) -> None:
    logits = _t(4, experts, dtype=dtype)
    moe_topk(logits, top_k=top_k, scoring=scoring, renormalise=renormalise, extra=extra)


def _moe_align(tokens: int) -> None:
    # 128 experts, top 8: a decode batch takes the one-program path, a prefill the three kernels
    moe_align(_ints(tokens * 8).view(tokens, 8), 128, 16)


def _fused_moe(
    dtype: torch.dtype, tokens: int, path: str, fp8: bool = False, rows: bool = False
) -> None:
    experts, top_k, hidden, inter = 128, 8, 2048, 768  # Qwen3-30B-A3B (its FP8 release: fp8)
    w_dtype = E4M3 if fp8 else dtype
    ib, hb = inter // 128, hidden // 128  # fp8: one fp32 scale per 128x128 block
    s13 = _t(experts, 2 * ib, hb, dtype=FP32) if fp8 else None
    s2 = _t(experts, hb, ib, dtype=FP32) if fp8 else None
    if rows:  # one scale a weight row instead
        s13, s2 = _t(experts, 2 * inter, dtype=FP32), _t(experts, hidden, dtype=FP32)
    fused_moe(
        _t(tokens, hidden, dtype=dtype),
        _t(experts, 2 * inter, hidden, dtype=w_dtype),
        _t(experts, hidden, inter, dtype=w_dtype),
        _t(tokens, top_k, dtype=FP32),
        _ints(tokens * top_k, torch.int32).view(tokens, top_k),
        path=path,
        w13_scale=s13,
        w2_scale=s2,
    )


def _cases() -> list[Case]:
    c: list[tuple[str, Callable[[], None]] | tuple[str, Callable[[], None], bool]] = [
        ("gemv/bf16-m1", partial(_gemv, BF16, 1)),
        ("gemv/fp16-m4-nopdl", partial(_gemv, FP16, 4), False),
        ("fp8_gemv/row-scales", partial(_fp8_gemv, False)),
        ("fp8_gemv/block-scales", partial(_fp8_gemv, True)),
        ("fp8_gemv/packed-bf16-m1", partial(_fp8_gemv, False, True, 1)),
        ("fp8_gemv/packed-fp16-m4-blocks", partial(_fp8_gemv, True, True, 4, FP16)),
        ("fp8_act_quant/per-token", partial(_quantize_act, 0, False)),
        ("fp8_act_quant/group-128", partial(_quantize_act, BLOCK, False)),
        ("fp8_act_quant/static", partial(_quantize_act, 0, True)),
        ("fp8_block_gemm/bf16", partial(_fp8_block_gemm, BF16)),
        ("fp8_gemm/bf16-rows", partial(_fp8_gemm, BF16, False)),
        ("fp8_gemm/fp16-blocks", partial(_fp8_gemm, FP16, True)),
        ("fp8_block_gemm/fp16", partial(_fp8_block_gemm, FP16)),
        ("w4a16_gemv/bf16-m1", partial(_w4a16, False, BF16, 128, False, 1)),
        ("w4a16_gemv/fp16-m4-act-order", partial(_w4a16, False, FP16, 32, True, 4)),
        ("w4a16_gemv/fp16-m2", partial(_w4a16, False, FP16, 128, False, 2)),
        ("w4a16_gemm/bf16-group-128", partial(_w4a16, True, BF16, 128, False, 64)),
        ("w4a16_gemm/bf16-m8", partial(_w4a16, True, BF16, 128, False, 8)),
        ("w4a16_gemm/bf16-m24", partial(_w4a16, True, BF16, 128, False, 24)),
        ("w4a16_gemm/fp16-group-32-act-order", partial(_w4a16, True, FP16, 32, True, 64)),
        ("w4a16_mma/bf16-m1-split-8", partial(_w4a16_mma, BF16, 128, 1, 8)),
        ("w4a16_mma/bf16-m8-split-4", partial(_w4a16_mma, BF16, 128, 8, 4)),
        ("w4a16_mma/fp16-m3-group-64", partial(_w4a16_mma, FP16, 64, 3, 8)),
        ("w4a16_mma/fp16-m2-group-256", partial(_w4a16_mma, FP16, 256, 2, 2)),
        ("w4a16_mma/bf16-m16-split-8", partial(_w4a16_mma, BF16, 128, 16, 8)),
        ("w4a16_mma/bf16-m64-split-4", partial(_w4a16_mma, BF16, 128, 64, 4)),
        ("w4a16_mma/fp16-m30-split-2", partial(_w4a16_mma, FP16, 128, 30, 2)),
        ("w4a16_mma/bf16-m1-ones-ahead-8", partial(_w4a16_mma, BF16, 128, 1, 4, 8, False)),
        ("w4a16_mma/fp16-m64-ones", partial(_w4a16_mma, FP16, 128, 64, 2, 4, False)),
        ("w4a16_mma/bf16-m1-group-32", partial(_w4a16_mma, BF16, 32, 1, 8)),
        ("w4a16_mma/fp16-m40-group-32-zsub", partial(_w4a16_mma, FP16, 32, 40, 2, 4, True)),
        ("w4a16_mma/bf16-m16-group-32-mins", partial(_w4a16_mma, BF16, 32, 16, 4, 2, None, True)),
        ("w4a16_mma/bf16-m1-mins", partial(_w4a16_mma, BF16, 128, 1, 4, 2, None, True)),
        ("w4a16_mma/bf16-m64-group-32-mins", partial(_w4a16_mma, BF16, 32, 64, 2, 4, None, True)),
        (
            "w4a16_mma/bf16-m1-group-32-scales-inside",
            partial(_w4a16_mma, BF16, 32, 1, 8, 2, None, True, True),
        ),
        (
            "w4a16_mma/fp16-m24-group-32-scales-inside",
            partial(_w4a16_mma, FP16, 32, 24, 2, 2, None, True, True),
        ),
        (
            "w4a16_mma/bf16-m64-group-32-scales-inside",
            partial(_w4a16_mma, BF16, 32, 64, 2, 4, None, True, True),
        ),
        ("w4a16_mma_dequant/bf16", partial(_w4a16_mma_dequant, BF16, 128)),
        ("w4a16_mma_dequant/fp16-group-64", partial(_w4a16_mma_dequant, FP16, 64)),
        ("w4a16_mma_dequant/bf16-group-32-mins", partial(_w4a16_mma_dequant, BF16, 32, True)),
        ("w4a16_mma_dequant/fp16-group-32", partial(_w4a16_mma_dequant, FP16, 32)),
        ("w4a16_dequant/bf16", partial(_w4a16_dequant, BF16, False)),
        ("w4a16_dequant/fp16-act-order", partial(_w4a16_dequant, FP16, True)),
        *((f"gguf_gemv/{q}", partial(_gguf, "gemv", q, BF16)) for q in LAYOUTS),
        *((f"gguf_dequant/{q}", partial(_gguf, "dequant", q, FP16)) for q in LAYOUTS),
        ("rmsnorm/bf16", partial(_rmsnorm, BF16, False, False)),
        ("rmsnorm/bf16-residual-nopdl", partial(_rmsnorm, BF16, True, False), False),
        ("rmsnorm/fp16-residual-unit-offset", partial(_rmsnorm, FP16, True, True)),
        ("rmsnorm/bf16-residual-top8-rows", partial(_rmsnorm, BF16, True, False, 8)),
        ("gated_act/silu-bf16", partial(_act, False, BF16)),
        ("gated_act/gelu-tanh-fp16", partial(_act, True, FP16)),
        ("argmax/fp32-llama3-vocab", _argmax),
        ("head_gemv/bf16", partial(_head_gemv, BF16)),
        ("bitmask/fp32", partial(_bitmask, FP32)),
        ("bitmask/bf16", partial(_bitmask, BF16)),
        ("rotary/bf16", partial(_rotary, BF16, 128, False, False, False)),
        ("rotary/fp16-partial", partial(_rotary, FP16, 64, False, False, False)),
        ("rotary/bf16-kv-store", partial(_rotary, BF16, 128, False, False, True)),
        ("rotary/bf16-qk-norm-kv-store", partial(_rotary, BF16, 128, True, False, True)),
        ("rotary/bf16-qk-norm-unit-offset", partial(_rotary, BF16, 128, True, True, False)),
        ("store_kv/bf16", partial(_store_kv, BF16, BF16)),
        ("store_kv/fp16-fp8-pool", partial(_store_kv, FP16, E4M3)),
        ("flat_slots/int64-table", partial(_flat_slots, torch.int64)),
        ("decode_attention/bf16", partial(_decode, BF16)),
        # what the backend launches for a lone long request: 64 chunks, three stages
        ("decode_attention/bf16-64-splits", partial(_decode, BF16, num_stages=3, splits=64)),
        ("decode_attention/fp16-3-stages-nopdl", partial(_decode, FP16, num_stages=3), False),
        ("decode_attention/bf16-e4m3-pool", partial(_decode, BF16, E4M3)),
        ("decode_attention/bf16-e5m2-pool", partial(_decode, BF16, E5M2)),
        ("decode_attention/bf16-pack4-3-stages", partial(_decode, BF16, num_stages=3, kv_pack=4)),
        ("decode_attention/bf16-e5m2-pool-pack4", partial(_decode, BF16, E5M2, kv_pack=4)),
        ("decode_attention/bf16-e4m3-pool-pack2", partial(_decode, BF16, E4M3, kv_pack=2)),
        (
            "decode_attention/bf16-e4m3-pool-early-k",
            partial(_decode, BF16, E4M3, early_k=True),
        ),
        (
            "decode_attention/bf16-e5m2-pool-pack4-early-kv-lazy",
            partial(_decode, BF16, E5M2, kv_pack=4, early_k=True, early_v=True, lazy_rescale=True),
        ),
        ("decode_attention/bf16-lazy", partial(_decode, BF16, lazy_rescale=True)),
        (
            "decode_attention/bf16-d256-pack2",  # the widest packed tiles choose_kv_pack makes
            partial(_decode, BF16, heads=16, kv_heads=8, head_dim=256, num_stages=3, kv_pack=2),
        ),
        ("decode_attention/fp16-e5m2-pool", partial(_decode, FP16, E5M2)),
        ("decode_attention/bf16-window", partial(_decode, BF16, window=4096)),
        (
            "decode_attention/bf16-window-softcap-hd256",
            partial(_decode, BF16, heads=16, head_dim=256, window=4096, softcap=50.0),
        ),
        ("decode_attention/fp32", partial(_decode, FP32, head_dim=64)),
        ("extend_attention/bf16-long", partial(_extend, BF16)),
        ("extend_attention/fp16-short", partial(_extend, FP16, max_extend_len=64)),
        ("extend_attention/bf16-e4m3-pool", partial(_extend, BF16, E4M3)),
        (
            "extend_attention/bf16-window-softcap-hd256",
            partial(_extend, BF16, head_dim=256, window=4096, softcap=50.0),
        ),
        ("extend_attention/fp32", partial(_extend, FP32, head_dim=64)),
        ("mla_decode/bf16", partial(_mla_decode, BF16)),
        ("mla_decode/bf16-e4m3-pool", partial(_mla_decode, BF16, E4M3)),
        ("mla_extend/bf16", partial(_mla_extend, BF16)),
        ("mla_extend/fp16-e5m2-pool-rank-128", partial(_mla_extend, FP16, E5M2, 128)),
        ("mla_prep/bf16-interleave", partial(_mla_prep, BF16, True, 1.0)),
        ("mla_prep/fp16-halves-mscale", partial(_mla_prep, FP16, False, 0.7)),
        ("moe_topk/bf16-softmax", partial(_moe_topk, BF16, 128, "softmax", False)),
        ("moe_topk/fp32-sigmoid-renormalise-512", partial(_moe_topk, FP32, 512, "sigmoid", True)),
        # DeepSeek-V2-Lite with its two shared experts stored as routed ones
        ("moe_topk/bf16-shared-slots", partial(_moe_topk, BF16, 64, "softmax", False, 6, 2)),
        ("moe_align/decode-one-program", partial(_moe_align, 4)),
        ("moe_align/prefill-three-kernels", partial(_moe_align, 512)),
        ("fused_moe/bf16-decode", partial(_fused_moe, BF16, 1, "grouped")),
        ("fused_moe/fp16-prefill", partial(_fused_moe, FP16, 512, "grouped")),
        ("fused_moe/bf16-fp8-blocks-decode", partial(_fused_moe, BF16, 1, "grouped", True)),
        ("fused_moe/bf16-fp8-blocks-prefill", partial(_fused_moe, BF16, 512, "grouped", True)),
        ("fused_moe/bf16-fp8-rows-decode", partial(_fused_moe, BF16, 1, "grouped", True, True)),
        ("moe_gemv/bf16", partial(_fused_moe, BF16, 1, "gemv")),
    ]
    return [Case(*entry) for entry in c]


CASES = _cases()
