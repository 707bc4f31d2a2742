"""FP8 (e4m3fn) weights and their scales, in torch: the one definition of each layout that the
loader, the quantizer, the CPU path and the kernels' references all use.

W ~ q * s, q in float8_e4m3fn (largest finite value 448), s in fp32:
- per tensor: one s;  per channel: s [N, 1], one per output row;
- 128x128 blocks (DeepSeek-V3, Qwen3-FP8: `weight_scale_inv`, a multiplier despite its
  name): s [ceil(N / 128), ceil(K / 128)], the last row and column of blocks partial when
  N or K is not a multiple of 128.
Each s is the block's (row's, tensor's) largest |W| / 448, so nothing saturates.
"""

from __future__ import annotations

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
BLOCK = 128  # the block scales' rows and columns
_TINY = 1e-12  # the scale of an all-zero block: any positive value gives zeros


def _cast(w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (w / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_tensor(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [1])."""
    w = w.float()
    scale = (w.abs().amax() / FP8_MAX).clamp(min=_TINY).reshape(1)
    return _cast(w, scale), scale


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [N, 1]): one scale per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / FP8_MAX).clamp(min=_TINY)
    return _cast(w, scale), scale


def quantize_blocks(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """(q [N, K], scale [ceil(N / block), ceil(K / block)])."""
    w = w.float()
    n, k = w.shape
    nb, kb = -(-n // block), -(-k // block)
    padded = torch.zeros(nb * block, kb * block, device=w.device)
    padded[:n, :k] = w.abs()
    amax = padded.view(nb, block, kb, block).amax(dim=(1, 3))
    scale = (amax / FP8_MAX).clamp(min=_TINY)
    return _cast(w, expand_blocks(scale, n, k, block)), scale


def expand_blocks(scale: torch.Tensor, n: int, k: int, block: int = BLOCK) -> torch.Tensor:
    """Block scales [ceil(n / block), ceil(k / block)] as one per element, [n, k]."""
    rows = scale.float().repeat_interleave(block, dim=0)[:n]
    return rows.repeat_interleave(block, dim=1)[:, :k]


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = 0) -> torch.Tensor:
    """q * scale in fp32, [N, K]: `scale` per tensor or per row (block 0) or per block."""
    if block:
        return q.float() * expand_blocks(scale, q.shape[0], q.shape[1], block)
    return q.float() * scale.float()
