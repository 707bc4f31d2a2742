"""Layers shared by the Llama family: RMSNorm, rotary embedding, SiLU-gated MLP.

The arithmetic follows transformers' modeling_llama step for step (norms and RoPE angles in
fp32, cast back afterwards) so fp32 logits match it to rounding error.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple, Protocol, overload

import torch
import torch.nn.functional as F
from torch import nn

from kernels.rope_freq import rope_attention_factor, rope_inv_freq
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.layers import ColumnParallelLinear, RowParallelLinear

if TYPE_CHECKING:
    from kernels.rotary import KVStore


def on_gpu(x: torch.Tensor) -> bool:
    """CUDA tensors take the Triton kernels of kernels/; the CPU keeps the torch reference."""
    return x.is_cuda


class RMSNorm(nn.Module):
    """`forward(x)` -> normed; `forward(x, residual)` -> (norm(x + residual), x + residual):
    the residual add is fused into the norm, as the decoder layers use it. With a residual,
    x may be [n, k, hidden]: a MoE layer's k per-expert rows of each token, summed first
    (SparseMoE.defer_sum)."""

    unit_offset = False  # the weight scales as w (Gemma's norms: 1 + w)

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    @overload
    def forward(self, x: torch.Tensor) -> torch.Tensor: ...
    @overload
    def forward(
        self, x: torch.Tensor, residual: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]: ...

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if on_gpu(x) and (x.dim() == 2 or (x.dim() == 3 and residual is not None)):
            from kernels.rmsnorm import rmsnorm

            out, new_residual = rmsnorm(x, self.weight, self.eps, residual=residual)
            return out if residual is None else (out, new_residual)
        if residual is not None:
            if x.dim() == 3:
                x = x.float().sum(1).to(x.dtype)
            x = x + residual
            residual = x
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        out = self.weight * x32.to(dtype)
        return out if residual is None else (out, residual)


class SiluAndMulMLP(nn.Module):
    """gate and up projections fused in one matmul (`gate_up_proj`: rows [0, I) gate, [I, 2I)
    up; the loader fills it from the checkpoint's gate_proj and up_proj). Under tensor
    parallelism I is this rank's share of the intermediate size."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, bias: bool = False, tp: TPGroup = SINGLE
    ) -> None:
        super().__init__()
        local = tp.shard(intermediate_size, "intermediate size")
        self.intermediate_size = local
        part = (intermediate_size, tp.rank * local, local)
        self.gate_up_proj = ColumnParallelLinear(hidden_size, [part, part], bias, tp)
        self.down_proj = RowParallelLinear(intermediate_size, hidden_size, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        if on_gpu(gate_up):
            from kernels.gated_act import silu_mul

            return self.down_proj(silu_mul(gate_up))
        gate, up = gate_up.split(self.intermediate_size, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class RotaryEmbedding(nn.Module):
    """RoPE for the positions of one batch. On the CPU: cos/sin tables computed per batch and
    shared by all layers; on CUDA: one cos/sin cache for every position, applied in place by
    a kernel (graph-friendly: no per-batch tables).

    head_dim is the width rotated: the model's rotary_dim, the first dims of each head (all
    of them but where a partial_rotary_factor says otherwise). max_positions is the context
    served (LongRoPE picks its factors from it: kernels/rope_freq.py says why)."""

    def __init__(
        self,
        head_dim: int,
        theta: float,
        scaling: dict[str, Any] | None,
        max_positions: int = 32768,
    ) -> None:
        super().__init__()
        # Plain attributes, not buffers: models are built on the meta device and then
        # `to_empty`-ed, which would wipe a buffer; weights never contain them either.
        self.head_dim, self.theta, self.scaling = head_dim, theta, scaling
        self.max_positions = max_positions
        self.inv_freq = rope_inv_freq(head_dim, theta, scaling, context=max_positions)
        self.attention_factor = rope_attention_factor(scaling)
        self.cos_sin_cache: torch.Tensor | None = None

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """positions [num_tokens] -> (cos, sin), each [num_tokens, head_dim] fp32."""
        if self.inv_freq.device != positions.device:
            self.inv_freq = self.inv_freq.to(positions.device)
        freqs = positions.float()[:, None] * self.inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        if self.attention_factor != 1.0:
            return emb.cos() * self.attention_factor, emb.sin() * self.attention_factor
        return emb.cos(), emb.sin()

    def prepare(self, positions: torch.Tensor) -> Rope:
        """What every layer of one forward applies to its q and k."""
        if on_gpu(positions):
            return Rope(positions, None, None, self.gpu_cache(positions.device))
        cos, sin = self(positions)
        return Rope(positions, cos, sin, None)

    def gpu_cache(self, device: torch.device) -> torch.Tensor:
        if self.cos_sin_cache is None or self.cos_sin_cache.device != device:
            from kernels.rotary import build_cos_sin_cache

            self.cos_sin_cache = build_cos_sin_cache(
                head_dim=self.head_dim,
                theta=self.theta,
                scaling=self.scaling,
                max_positions=self.max_positions,
                device=device,
            )
        return self.cos_sin_cache


class HeadNorm(Protocol):
    """A per-head q or k norm (RMSNorm, Gemma's GemmaRMSNorm): its weight and eps for the
    fused CUDA kernel, its own forward on [n, heads, head_dim] for the CPU."""

    weight: nn.Parameter
    eps: float
    unit_offset: bool

    def __call__(self, x: torch.Tensor) -> Any: ...


class Rope(NamedTuple):
    positions: torch.Tensor  # [num_tokens]
    cos: torch.Tensor | None  # CPU path: [num_tokens, rotary_dim] fp32
    sin: torch.Tensor | None
    cos_sin_cache: torch.Tensor | None  # CUDA path: [max_positions, rotary_dim] fp32

    def apply(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        norms: tuple[HeadNorm, HeadNorm] | None = None,
        store: KVStore | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [n, heads, head_dim], k [n, kv_heads, head_dim] -> rotated (in place on CUDA),
        each head normed by `norms` (q's, k's) first: on CUDA in the same kernel, which also
        writes k and v to the pool with a `store` (the CUDA path only)."""
        if self.cos_sin_cache is not None:
            from kernels.rotary import QKNorm
            from kernels.rotary import apply_rotary as rotary_kernel

            fused = None
            if norms is not None:
                qn, kn = norms
                fused = QKNorm(qn.weight, kn.weight, qn.eps, qn.unit_offset)
            rotary_kernel(
                q=q,
                k=k,
                positions=self.positions,
                cos_sin_cache=self.cos_sin_cache,
                norm=fused,
                store=store,
            )
            return q, k
        assert store is None, "the pool store is fused on the CUDA path only"
        assert self.cos is not None and self.sin is not None
        if norms is not None:
            q, k = norms[0](q), norms[1](k)
        return apply_rotary(q, self.cos, self.sin), apply_rotary(k, self.cos, self.sin)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half ("neox") RoPE. x: [num_tokens, num_heads, head_dim]; cos/sin from above,
    rotary_dim wide: x's dims from rotary_dim on pass through."""
    rotary_dim = cos.shape[-1]
    if rotary_dim < x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), -1)
    cos = cos.to(x.dtype)[:, None, :]
    sin = sin.to(x.dtype)[:, None, :]
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
