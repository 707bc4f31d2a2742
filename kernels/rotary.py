"""Rotary embedding ("neox" rotate-half, as HF Llama) applied to q and k in place.

The cos/sin of every position come from a cache built once per model (`build_cos_sin_cache`):
row p is [cos(p * inv_freq), sin(p * inv_freq)] (times LongRoPE's attention factor), each
rotary_dim / 2 wide, computed exactly as the models' RotaryEmbedding does (the inv_freq of
kernels/rope_freq.py, Llama-3, linear and LongRoPE scaling included). rotary_dim is the cache's
width: head_dim, or less where a model rotates only the first dims of each head (the rest pass
through untouched). For i < rotary_dim / 2, with x1 = x[i], x2 = x[i + rotary_dim / 2]:
x[i] <- x1 cos - x2 sin, x[i + rotary_dim / 2] <- x2 cos + x1 sin, in fp32, rounded once.

Grid: (num_tokens,); a program rotates all q heads and all k heads of one token.
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor
from kernels.rope_freq import rope_attention_factor, rope_inv_freq


@triton.jit
def _rotate_heads(
    x_ptr, stride_h, num_heads, cos, sin, offs_d, d_mask, HALF: tl.constexpr, BLOCK_H: tl.constexpr
):
    """Rotate rows x_ptr + h * stride_h, h < num_heads, BLOCK_H heads at a time."""
    for h0 in range(0, num_heads, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask = (offs_h < num_heads)[:, None] & d_mask[None, :]
        ptr1 = x_ptr + offs_h[:, None] * stride_h + offs_d[None, :]
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr1 + HALF, mask=mask, other=0.0).to(tl.float32)
        o1 = x1 * cos[None, :] - x2 * sin[None, :]
        o2 = x2 * cos[None, :] + x1 * sin[None, :]
        tl.store(ptr1, o1.to(x_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr1 + HALF, o2.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rotary_kernel(
    q_ptr,
    k_ptr,
    positions_ptr,
    cache_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_cache,
    num_q_heads,
    num_k_heads,
    HALF: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs_d = tl.arange(0, BLOCK_HALF)
    d_mask = offs_d < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs_d, mask=d_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs_d, mask=d_mask, other=0.0)
    _rotate_heads(
        q_ptr + tok * stride_qt, stride_qh, num_q_heads, cos, sin, offs_d, d_mask, HALF, BLOCK_H
    )
    _rotate_heads(
        k_ptr + tok * stride_kt, stride_kh, num_k_heads, cos, sin, offs_d, d_mask, HALF, BLOCK_H
    )


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
    *, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """Rotate q [n, num_heads, head_dim] and k [n, num_kv_heads, head_dim] in place.

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
    if n == 0:
        return
    half = rotary_dim // 2
    block_half = triton.next_power_of_2(half)
    _rotary_kernel[(n,)](
        q,
        k,
        positions.contiguous(),
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        cos_sin_cache.stride(0),
        num_heads,
        k.shape[1],
        HALF=half,
        BLOCK_HALF=block_half,
        BLOCK_H=max(1, min(triton.next_power_of_2(num_heads), 4096 // block_half)),
        num_warps=4,
    )


def apply_rotary_ref(
    *, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor
) -> None:
    """The torch twin of `apply_rotary` (in place, fp32 math, rounded once)."""
    half = cos_sin_cache.shape[1] // 2
    cos_sin = cos_sin_cache[positions]
    cos, sin = cos_sin[:, None, :half], cos_sin[:, None, half:]
    for x in (q, k):
        x1, x2 = x[..., :half].float(), x[..., half : 2 * half].float()
        rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
        x[..., : 2 * half].copy_(rotated.to(x.dtype))
