"""RoPE's inverse frequencies from a model's config: plain, linear, per-dimension factors,
Llama 3's scaling and YaRN's (DeepSeek's "yarn"/"deepseek_yarn"). Pure torch, on the CPU:
the model's rotary layer and the rotary kernel's cos/sin cache both start from it (so this
module imports neither Triton nor the services).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], fp32 on the CPU, with the config's scaling applied."""
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
    if rope_type in ("yarn", "deepseek_yarn"):
        return _yarn_inv_freq(inv_freq, head_dim, theta, scaling)
    raise ValueError(f"unknown rope type {rope_type!r}")


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
