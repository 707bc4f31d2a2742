"""RoPE's inverse frequencies from a model's config: plain, linear, per-dimension factors,
Llama 3's scaling, Phi-3's LongRoPE and YaRN's (DeepSeek's "yarn"/"deepseek_yarn"). Pure
torch, on the CPU: the model's rotary layer and the rotary kernel's cos/sin cache both start
from it (so this module imports neither Triton nor the services).

`head_dim` here is the rotated width: all of a head, or its first `rotary_dim` dims where a
model rotates only part of each head (Phi-4-mini's partial_rotary_factor).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, context: int | None = None
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], fp32 on the CPU, with the config's scaling applied.

    context: the context length served (LongRoPE picks its factors from it; others ignore it).
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None:
        return inv_freq
    rope_type = scaling["rope_type"]
    if rope_type == "linear":
        return inv_freq / scaling["factor"]
    if rope_type == "freq_factors":
        factors = torch.tensor(scaling["freq_factors"], dtype=torch.float32, device="cpu")
        return inv_freq / factors
    if rope_type == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    if rope_type == "longrope":
        picked = longrope_factors(scaling, context)
        factors = torch.tensor(picked, dtype=torch.float32, device="cpu")
        return 1.0 / (factors * theta**exponents)
    if rope_type in ("yarn", "deepseek_yarn"):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unknown rope type {rope_type!r}")


def longrope_factors(scaling: dict[str, Any], context: int | None) -> list[float]:
    """LongRoPE's per-frequency divisors: the long ones when the served context exceeds the
    original (pre-training) one, else the short ones, for every position of every request.

    transformers switches per forward pass, by the length of the sequence so far: a prefix
    would then be rotated one way while short and another once the request grew past the
    original context, and its cached keys (radix cache, KV pool) would depend on how long
    the request later gets. Choosing once from the served context, as vLLM and llama.cpp do,
    keeps every key a function of its position alone. Both agree with transformers for
    sequences within the original context when it is the context served, and for sequences
    past it when a longer one is.
    """
    if context is None:
        raise ValueError("longrope needs the served context length to pick its factors")
    long = context > scaling["original_max_position_embeddings"]
    return [float(f) for f in scaling["long_factor" if long else "short_factor"]]


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by (LongRoPE's attention factor; 1 elsewhere)."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    return float(scaling["attention_factor"])


def _llama3_inv_freq(inv_freq: torch.Tensor, s: dict[str, Any]) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_context = s["original_max_position_embeddings"]
    low_freq_wavelen = old_context / low
    high_freq_wavelen = old_context / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_inv_freq(
    inv_freq: torch.Tensor, head_dim: int, theta: float, s: dict[str, Any]
) -> torch.Tensor:
    # High frequencies (many turns over the old context) are kept, low ones divided by
    # `factor`, with a linear ramp between the dims turning beta_fast and beta_slow times.
    # YaRN's attention factor (mscale) is not a frequency: the model applies it.
    factor = float(s["factor"])
    old_context = s["original_max_position_embeddings"]
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def dim_for(turns: float) -> float:
        return head_dim * math.log(old_context / (turns * 2 * math.pi)) / (2 * math.log(theta))

    low, high = dim_for(beta_fast), dim_for(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    dims = torch.arange(head_dim // 2, dtype=torch.float32, device="cpu")
    ramp = ((dims - low) / (high - low)).clamp(0, 1)
    keep = 1 - ramp  # 1: extrapolate (keep the frequency), 0: interpolate
    return inv_freq / factor * (1 - keep) + inv_freq * keep
