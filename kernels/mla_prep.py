"""DeepSeek MLA's step between the projections and attention, in one launch.

What the latent attention layer (services/executor/models/deepseek.py) needs from
q = q_proj(x) [n, heads, nope + rope] and kv = kv_a_proj_with_mqa(x) [n, rank + rope]:
- the query's rotated part: q's last `rope` dims, de-interleaved where the checkpoint pairs
  them (x0, x1), (x2, x3)..., rotated (rotate-half, the YaRN cos/sin cache), scaled by the
  rope mscale, written to query[:, :, rank:] (the absorbed part, query[:, :, :rank], is
  kernels/head_gemv's or a bmm's);
- the new token's cache row: kv_a_layernorm(kv[:rank]) then the rotated key part the same
  way, written straight into the latent pool at the token's slot.
In torch that is two de-interleaving copies, a rotary launch, a norm on a strided view, two
concatenations and an indexed store: about a dozen launches a layer. Rounding is the torch
path's: the norm as layers.RMSNorm, the rotation once, the mscale product once more.

Grid: (n, head blocks + 1); the last program of a token writes its cache row.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, INDEX_DTYPES, check_device, check_tensor, next_pow2
from kernels.pdl import pdl_launch, pdl_prologue
from kernels.rmsnorm import rmsnorm_ref
from kernels.rotary import _normed

_BLOCK_H = 16  # query heads per program


@triton.jit
def _rotated_halves(ptr, cos, sin, offs, mask, INTERLEAVE: tl.constexpr, HALF: tl.constexpr):
    """A [rows, HALF] tile's two rotated halves (fp32) from the rope part at ptr[rows, :]."""
    if INTERLEAVE:
        x1 = tl.load(ptr + 2 * offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + 2 * offs + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    return x1 * cos - x2 * sin, x2 * cos + x1 * sin


@triton.jit
def _scaled(x, mscale, DTYPE: tl.constexpr, USE_MSCALE: tl.constexpr):
    """x rounded to DTYPE, then times mscale rounded again (the torch path's two steps)."""
    x = x.to(DTYPE)
    if USE_MSCALE:
        x = (x.to(tl.float32) * mscale).to(DTYPE)
    return x


@triton.jit
def _mla_prep_kernel(
    q_ptr,
    kv_ptr,
    query_ptr,
    buf_ptr,
    loc_ptr,
    positions_ptr,
    cache_ptr,
    norm_ptr,
    stride_qt,
    stride_qh,
    stride_kvt,
    stride_yt,
    stride_yh,
    stride_bt,
    stride_cache,
    num_heads,
    eps,
    mscale,
    RANK: tl.constexpr,
    NOPE: tl.constexpr,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    USE_MSCALE: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_HALF: tl.constexpr,
    BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    pdl_prologue(PDL)
    tok = tl.program_id(0).to(tl.int64)
    block = tl.program_id(1)
    dtype = query_ptr.dtype.element_ty
    pos = tl.load(positions_ptr + tok).to(tl.int64)
    offs = tl.arange(0, BLOCK_HALF)
    half_mask = offs < HALF
    cos = tl.load(cache_ptr + pos * stride_cache + offs, mask=half_mask, other=0.0)
    sin = tl.load(cache_ptr + pos * stride_cache + HALF + offs, mask=half_mask, other=0.0)
    if block < tl.cdiv(num_heads, BLOCK_H):
        heads = block * BLOCK_H + tl.arange(0, BLOCK_H)
        mask = (heads < num_heads)[:, None] & half_mask[None, :]
        src = q_ptr + tok * stride_qt + heads[:, None] * stride_qh + NOPE
        o1, o2 = _rotated_halves(
            src, cos[None, :], sin[None, :], offs[None, :], mask, INTERLEAVE, HALF
        )
        dst = query_ptr + tok * stride_yt + heads[:, None] * stride_yh + RANK + offs[None, :]
        tl.store(dst, _scaled(o1, mscale, dtype, USE_MSCALE), mask=mask)
        tl.store(dst + HALF, _scaled(o2, mscale, dtype, USE_MSCALE), mask=mask)
    else:
        slot = tl.load(loc_ptr + tok).to(tl.int64)
        row = buf_ptr + slot * stride_bt
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < RANK
        latent = tl.load(kv_ptr + tok * stride_kvt + offs_r, mask=r_mask, other=0.0)
        latent = latent.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(latent * latent, 0) / RANK + eps)
        w = tl.load(norm_ptr + offs_r, mask=r_mask, other=0.0).to(tl.float32)
        tl.store(row + offs_r, _normed(latent, rstd, w, False, dtype).to(dtype), mask=r_mask)
        # Names unlike the query branch's: compiled Triton merges same-named values of both
        # branches, which must then share a shape (the interpreter does not check).
        k_src = kv_ptr + tok * stride_kvt + RANK
        k1, k2 = _rotated_halves(k_src, cos, sin, offs, half_mask, INTERLEAVE, HALF)
        tl.store(row + RANK + offs, _scaled(k1, mscale, dtype, USE_MSCALE), mask=half_mask)
        tl.store(row + RANK + HALF + offs, _scaled(k2, mscale, dtype, USE_MSCALE), mask=half_mask)


def mla_prep(
    *,
    q: torch.Tensor,
    kv: torch.Tensor,
    query: torch.Tensor,
    buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rank: int,
    interleave: bool,
    mscale: float = 1.0,
) -> None:
    """Write the rotated query part into `query` and each token's cache row into `buffer`.

    q: [n, heads, nope + rope] (heads contiguous in their last dim); kv: [n, rank + rope];
    query: [n, heads, rank + rope] (its first `rank` dims are not touched); buffer: one layer's
    latent pool [slots, 1, rank + rope] in q's dtype; out_cache_loc, positions: [n] ints;
    cos_sin_cache: [max_positions, rope] fp32 (kernels/rotary.py); norm_weight: [rank].
    """
    op = "mla_prep"
    check_tensor(op, "q", q, shape=(None, None, None), dims="[n, heads, d]", dtypes=FLOAT_DTYPES)
    check_device(op, q)
    n, heads, q_dim = q.shape
    dev, dtype = q.device, q.dtype
    rope = cos_sin_cache.shape[1] if cos_sin_cache.dim() == 2 else -1
    check_tensor(
        op,
        "cos_sin_cache",
        cos_sin_cache,
        shape=(None, None),
        dims="[max_positions, rope]",
        dtypes=(torch.float32,),
        device=dev,
    )
    if rope % 2 or rope > q_dim:
        raise ValueError(f"{op}: the rope width {rope} must be even and at most q's {q_dim}")
    width = rank + rope
    check_tensor(op, "kv", kv, shape=(n, width), dims="[n, rank + rope]", dtypes=(dtype,))
    check_tensor(
        op, "query", query, shape=(n, heads, width), dims="[n, heads, rank + rope]", dtypes=(dtype,)
    )
    check_tensor(
        op,
        "buffer",
        buffer,
        shape=(None, 1, width),
        dims="[slots, 1, rank + rope]",
        dtypes=(dtype,),
    )
    check_tensor(op, "norm_weight", norm_weight, shape=(rank,), dims="[rank]", dtypes=(dtype,))
    for name, t in (("out_cache_loc", out_cache_loc), ("positions", positions)):
        check_tensor(op, name, t, shape=(n,), dims="[n]", dtypes=INDEX_DTYPES, device=dev)
    if query.stride(2) != 1 or buffer.stride(2) != 1:
        raise ValueError(f"{op}: query and buffer rows must be contiguous")
    if n == 0:
        return
    grid = (n, triton.cdiv(heads, _BLOCK_H) + 1)
    _mla_prep_kernel[grid](
        q, kv, query, buffer, out_cache_loc.contiguous(), positions.contiguous(),
        cos_sin_cache, norm_weight,
        q.stride(0), q.stride(1), kv.stride(0), query.stride(0), query.stride(1),
        buffer.stride(0), cos_sin_cache.stride(0),
        heads, eps, mscale,
        RANK=rank,
        NOPE=q_dim - rope,
        HALF=rope // 2,
        INTERLEAVE=interleave,
        USE_MSCALE=mscale != 1.0,
        BLOCK_R=next_pow2(rank),
        BLOCK_HALF=next_pow2(rope // 2),
        BLOCK_H=_BLOCK_H,
        num_warps=4,
        **pdl_launch(dev),
    )  # fmt: skip


def _rotate_ref(
    x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool, mscale: float
) -> torch.Tensor:
    """x [n, heads, rope] (the checkpoint's pair order) -> de-interleaved, rotated, scaled."""
    if interleave:
        x = x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    c, s = cos[:, None, :], sin[:, None, :]
    out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(x.dtype)
    return out if mscale == 1.0 else (out.float() * mscale).to(x.dtype)


def mla_prep_ref(
    *,
    q: torch.Tensor,
    kv: torch.Tensor,
    query: torch.Tensor,
    buffer: torch.Tensor,
    out_cache_loc: torch.Tensor,
    positions: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    rank: int,
    interleave: bool,
    mscale: float = 1.0,
) -> None:
    """The torch twin of `mla_prep` (in place on query and buffer)."""
    rope = cos_sin_cache.shape[1]
    half = rope // 2
    cs = cos_sin_cache[positions.long()]
    cos, sin = cs[:, :half], cs[:, half:]
    query[:, :, rank:] = _rotate_ref(q[:, :, -rope:], cos, sin, interleave, mscale)
    latent = rmsnorm_ref(kv[:, :rank], norm_weight, eps)[0]
    k_pe = _rotate_ref(kv[:, None, rank:], cos, sin, interleave, mscale)[:, 0]
    buffer[out_cache_loc.long(), 0] = torch.cat((latent, k_pe), dim=-1)
