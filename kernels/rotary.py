"""Rotary embedding ("neox" rotate-half, as HF Llama) applied to q and k in place.

The cos/sin of every position come from a cache built once per model (`build_cos_sin_cache`):
row p is [cos(p * inv_freq), sin(p * inv_freq)] (times LongRoPE's attention factor), each
rotary_dim / 2 wide, computed exactly as the models' RotaryEmbedding does (the inv_freq of
kernels/rope_freq.py, Llama-3, linear and LongRoPE scaling included). rotary_dim is the cache's
width: head_dim, or less where a model rotates only the first dims of each head (the rest pass
through untouched). For i < rotary_dim / 2, with x1 = x[i], x2 = x[i + rotary_dim / 2]:
x[i] <- x1 cos - x2 sin, x[i + rotary_dim / 2] <- x2 cos + x1 sin, in fp32, rounded once.

With a `QKNorm` (Qwen3's and Gemma 3's per-head RMSNorm on q and k before RoPE), each head is
normed first, in the same program, rounded as the models' norm rounds it (to x's dtype), and
then rotated: the norm costs no launch and no extra pass over q and k. Dims past rotary_dim
are normed and left unrotated.

Grid: (num_tokens, head blocks of q then of k); a program rotates BLOCK_H heads of one token,
so a decode step's few tokens still spread over many programs.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor, next_pow2
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.rmsnorm import rmsnorm_ref
from kernels.rope_freq import rope_attention_factor, rope_inv_freq


class QKNorm(NamedTuple):
    """Per-head RMSNorm of q and k before rotation: weights [head_dim] each (x's dtype). Plain:
    w * rmsnorm(x) rounded as layers.RMSNorm does; unit_offset (Gemma): (1 + w) in fp32."""

    q_weight: torch.Tensor
    k_weight: torch.Tensor
    eps: float
    unit_offset: bool = False


class KVStore(NamedTuple):
    """Where the rotated k (and v, as it is) go as well: one layer's pool buffers [slots,
    kv_heads, head_dim] in k's dtype, at the tokens' slots [n]. Saves store_kv's launch."""

    v: torch.Tensor
    k_buffer: torch.Tensor
    v_buffer: torch.Tensor
    out_cache_loc: torch.Tensor


@triton.jit
def _normed(x, rstd, w, UNIT_OFFSET: tl.constexpr, DTYPE: tl.constexpr):
    """x (fp32) normed by rstd and scaled by w, rounded to DTYPE as the torch norms round."""
    if UNIT_OFFSET:
        return (x * rstd * (w + 1.0)).to(DTYPE).to(tl.float32)
    normed = (x * rstd).to(DTYPE).to(tl.float32)
    return (w * normed).to(DTYPE).to(tl.float32)


@triton.jit
def _rotate_heads(
    x_ptr,
    stride_h,
    h_start,
    num_heads,
    cos,
    sin,
    offs_d,
    d_mask,
    w_ptr,
    eps,
    head_dim,
    HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    """Rotate rows x_ptr + h * stride_h for h in [h_start, min(h_start + BLOCK_H,
    num_heads)); with NORM, RMSNorm each row (weight w_ptr) first."""
    dtype = x_ptr.dtype.element_ty
    if NORM:
        offs_full = tl.arange(0, BLOCK_D)
        full_mask = offs_full < head_dim
        w_full = tl.load(w_ptr + offs_full, mask=full_mask, other=0.0).to(tl.float32)
        w1 = tl.load(w_ptr + offs_d, mask=d_mask, other=0.0).to(tl.float32)
        w2 = tl.load(w_ptr + HALF + offs_d, mask=d_mask, other=0.0).to(tl.float32)
    offs_h = h_start + tl.arange(0, BLOCK_H)
    h_mask = offs_h < num_heads
    mask = h_mask[:, None] & d_mask[None, :]
    ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
    x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
    if NORM:
        # the whole head for its mean square; the rotated halves are normed below and the
        # dims past rotary_dim stored normed here (disjoint from the rotated ones)
        ptr_full = x_ptr + offs_h[:, None] * stride_h + offs_full[None, :]
        f_mask = h_mask[:, None] & full_mask[None, :]
        xf = tl.load(ptr_full, mask=f_mask, other=0.0).to(tl.float32)
        rstd = (1.0 / tl.sqrt(tl.sum(xf * xf, 1) / head_dim + eps))[:, None]
        rest = _normed(xf, rstd, w_full[None, :], UNIT_OFFSET, dtype)
        tl.store(ptr_full, rest.to(dtype), mask=f_mask & (offs_full >= 2 * HALF)[None, :])
        x1 = _normed(x1, rstd, w1[None, :], UNIT_OFFSET, dtype)
        x2 = _normed(x2, rstd, w2[None, :], UNIT_OFFSET, dtype)
    o1 = x1 * cos[None, :] - x2 * sin[None, :]
    o2 = x2 * cos[None, :] + x1 * sin[None, :]
    tl.store(ptr1, o1.to(dtype), mask=mask)
    tl.store(ptr1 + HALF, o2.to(dtype), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    wq_ptr,
    wk_ptr,
    v_ptr,
    kbuf_ptr,
    vbuf_ptr,
    loc_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_kbt,
    stride_kbh,
    stride_vbt,
    stride_vbh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    head_dim,
    eps,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    NORM: tl.constexpr,
    UNIT_OFFSET: tl.constexpr,
    BLOCK_D: tl.constexpr,
    STORE: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    q_blocks = tl.cdiv(num_q_heads, BLOCK_H)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=d_mask, other=0.0)
    if block < q_blocks:
        x_ptr, stride_h, w_ptr, heads = q_ptr + tok * stride_qt, stride_qh, wq_ptr, num_q_heads
        h_start = block * BLOCK_H
    else:
        x_ptr, stride_h, w_ptr, heads = k_ptr + tok * stride_kt, stride_kh, wk_ptr, num_k_heads
        h_start = (block - q_blocks) * BLOCK_H
    _rotate_heads(
        x_ptr,
        stride_h,
        h_start,
        heads,
        cos,
        sin,
        offs_d,
        d_mask,
        w_ptr,
        eps,
        head_dim,
        HALF,
        BLOCK_H,
        NORM,
        UNIT_OFFSET,
        BLOCK_D,
    )
    if STORE and block >= q_blocks:
        # this program's k rows, rotated and stored above by other threads, read back whole
        tl.debug_barrier()
        offs_h = h_start + tl.arange(0, BLOCK_H)
        offs_f = tl.arange(0, BLOCK_D)
        mask = (offs_h < num_k_heads)[:, None] & (offs_f < head_dim)[None, :]
        slot = tl.load(loc_ptr + tok).to(tl.int64)
        k_rows = tl.load(k_ptr + tok * stride_kt + offs_h[:, None] * stride_kh + offs_f, mask)
        dst = kbuf_ptr + slot * stride_kbt + offs_h[:, None] * stride_kbh + offs_f
        tl.store(dst, k_rows, mask=mask)
        v_rows = tl.load(v_ptr + tok * stride_vt + offs_h[:, None] * stride_vh + offs_f, mask)
        dst = vbuf_ptr + slot * stride_vbt + offs_h[:, None] * stride_vbh + offs_f
        tl.store(dst, v_rows, mask=mask)


def build_cos_sin_cache(
    *,
    head_dim: int,
    theta: float,
    scaling: dict[str, Any] | None,
    max_positions: int,
    device: torch.device | str,
) -> torch.Tensor:
    """[max_positions, head_dim] fp32: row p = cat(cos(p * inv_freq), sin(p * inv_freq)).

    head_dim: the width rotated (a model's rotary_dim); max_positions: the context served
    (LongRoPE picks its factors from it). The same fp32 products as layers.RotaryEmbedding,
    so the cached values are bit-equal to what it computes for the same positions on the
    same device.
    """
    inv_freq = rope_inv_freq(head_dim, theta, scaling, context=max_positions).to(device)
    positions = torch.arange(max_positions, dtype=torch.int64, device=device)
    freqs = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    factor = rope_attention_factor(scaling)
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return torch.cat((cos, sin), dim=-1).contiguous()


def apply_rotary(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norm: QKNorm | None = None,
    store: KVStore | None = None,
) -> None:
    """Rotate q [n, num_heads, head_dim] and k [n, num_kv_heads, head_dim] in place (each
    head RMS-normed first with `norm`); with `store`, also write the rotated k and v to the
    pool (v: k's shape; buffers in k's dtype: an fp8 pool takes store_kv's cast).

    Any token/head strides (q and k may be views of one fused qkv tensor). positions: [n]
    ints, each < cos_sin_cache.shape[0] (not checked: that would sync the host).
    cos_sin_cache: [max_positions, rotary_dim] fp32 from `build_cos_sin_cache`; rotary_dim
    even and at most head_dim: dims from rotary_dim on are left as they are.
    """
    op = "apply_rotary"
    check_tensor(op, "q", q, shape=(None, None, None), dims="[n, heads, d]", dtypes=FLOAT_DTYPES)
    check_device(op, q)
    n, num_heads, head_dim = q.shape
    dev = q.device
    if head_dim % 2:
        raise ValueError(f"{op}: head_dim must be even, got {head_dim}")
    check_tensor(
        op,
        "k",
        k,
        shape=(n, None, head_dim),
        dims="[n, kv_heads, d]",
        dtypes=(q.dtype,),
        device=dev,
    )
    check_tensor(
        op, "positions", positions, shape=(n,), dims="[n]", dtypes=INDEX_DTYPES, device=dev
    )
    check_tensor(
        op,
        "cos_sin_cache",
        cos_sin_cache,
        shape=(None, None),
        dims="[max_positions, rotary_dim]",
        dtypes=(torch.float32,),
        device=dev,
    )
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
        raise ValueError(
            f"{op}: cos_sin_cache's rotary_dim must be even and in (0, head_dim = {head_dim}], "
            f"got {rotary_dim}"
        )
    if norm is not None:
        for name, w in (("norm.q_weight", norm.q_weight), ("norm.k_weight", norm.k_weight)):
            check_tensor(op, name, w, shape=(head_dim,), dims="[d]", dtypes=(q.dtype,), device=dev)
    if store is not None:
        _check_store(op, store, k)
    if n == 0:
        return
    if q.stride(2) != 1 or k.stride(2) != 1:
        raise ValueError(f"{op}: q and k must have contiguous heads (last stride 1)")
    half = rotary_dim // 2
    block_half = next_pow2(half)
    block_d = next_pow2(head_dim)
    # a few heads a program: 8 of 128 dims (decode's one token still fills a few programs)
    block_h = max(1, min(next_pow2(max(num_heads, k.shape[1])), 1024 // block_d))
    grid = (n, triton.cdiv(num_heads, block_h) + triton.cdiv(k.shape[1], block_h))
    _rotary_kernel[grid](
        q,
        k,
        positions.contiguous(),
        cos_sin_cache,
        q if norm is None else norm.q_weight,  # unused without NORM
        k if norm is None else norm.k_weight,
        *(k, k, k) if store is None else store[:3],  # unused without STORE
        positions if store is None else store.out_cache_loc,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        *(0, 0, 0, 0, 0, 0) if store is None else _store_strides(store),
        cos_sin_cache.stride(0),
        num_heads,
        k.shape[1],
        head_dim,
        0.0 if norm is None else norm.eps,
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=block_h,
        NORM=norm is not None,
        UNIT_OFFSET=norm is not None and norm.unit_offset,
        BLOCK_D=block_d,
        STORE=store is not None,
        num_warps=4,
        **pdl_launch(q.device),
    )


def _check_store(op: str, store: KVStore, k: torch.Tensor) -> None:
    shape = (None, k.shape[1], k.shape[2])
    check_tensor(op, "store.v", store.v, shape=k.shape, dims="[n, kv_heads, d]", dtypes=(k.dtype,))
    for name, buf in (("store.k_buffer", store.k_buffer), ("store.v_buffer", store.v_buffer)):
        dims = "[slots, kv_heads, d]"
        check_tensor(op, name, buf, shape=shape, dims=dims, dtypes=(k.dtype,), device=k.device)
    loc = store.out_cache_loc
    check_tensor(
        op, "store.out_cache_loc", loc, shape=(k.shape[0],), dims="[n]", dtypes=INDEX_DTYPES
    )
    if store.v.stride(2) != 1:
        raise ValueError(f"{op}: store.v must have contiguous heads (last stride 1)")


def _store_strides(store: KVStore) -> tuple[int, ...]:
    v, kb, vb = store.v, store.k_buffer, store.v_buffer
    return (v.stride(0), v.stride(1), kb.stride(0), kb.stride(1), vb.stride(0), vb.stride(1))


def apply_rotary_ref(
    *,
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norm: QKNorm | None = None,
    store: KVStore | None = None,
) -> None:
    """The torch twin of `apply_rotary` (in place, fp32 math, rounded once after the norm
    and once after the rotation)."""
    if norm is not None:
        for x, w in ((q, norm.q_weight), (k, norm.k_weight)):
            x.copy_(rmsnorm_ref(x, w, norm.eps, unit_offset=norm.unit_offset)[0])
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half].copy_(rotated.to(x.dtype))
    if store is not None:
        loc = store.out_cache_loc.long()
        store.k_buffer[loc], store.v_buffer[loc] = k, store.v
