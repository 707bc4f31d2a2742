"""GGUF Q4_K weights in the int4 MMA's layout (kernels/w4a16_mma.py), for decode batches.

A Q4_K block's sub-block j of 32 weights is w = d * scale[j] * q - dmin * min[j] (q 4 bits,
kernels/gguf_blocks.py): a group of 32 columns with a float scale and a float min, which
`w4a16_mma` takes with `group_size=32` (its layout of their own) and `mins`. `q4k_to_mma`
converts a weight's rows of blocks once, at load:
the nibbles shuffled for the MMA, each sub-block's scale d * scale[j] and min dmin * min[j]
rounded to `dtype`. A 16-bit model converts them to its own type, which the MMA takes inside
its A fragments (s q rounded once to that type: in bf16 a relative 2^-9, a bf16 weight's own
rounding; kernels/w4a16_mma.py); fp32 keeps them exact (the kernel then folds each group's
sums). Bytes a weight: 0.5 + 4 / 32 with 16-bit scales (0.625, against the blocks' 0.5625).
"""

from __future__ import annotations

import torch

from kernels.gguf_blocks import q4k_fields, row_bytes
from kernels.w4a16 import pack_int4
from kernels.w4a16_mma import G32, shuffle_w4


def q4k_to_mma(
    blocks: torch.Tensor, k: int, dtype: torch.dtype = torch.float16
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rows of Q4_K blocks, uint8 [n, row_bytes("Q4_K", k)] -> (qmma int32 [n / 16, k / 64,
    32, 4], scales and mins [n, k / 32] in `dtype`) for `w4a16_mma(..., group_size=32,
    mins=mins)`. n must be a multiple of 16; a slice of rows at a time."""
    n = blocks.shape[0]
    if blocks.dtype != torch.uint8 or blocks.shape != (n, row_bytes("Q4_K", k)):
        raise ValueError(
            f"q4k_to_mma: blocks must be uint8 [n, {row_bytes('Q4_K', k)}] for k = {k}, got "
            f"{blocks.dtype} {tuple(blocks.shape)}"
        )
    if n % 16:
        raise ValueError(f"q4k_to_mma: n must be a multiple of 16, got {n}")
    qmma = torch.empty((n // 16, k // 64, 32, 4), dtype=torch.int32, device=blocks.device)
    scales = torch.empty((n, k // G32), dtype=dtype, device=blocks.device)
    mins = torch.empty_like(scales)
    step = max(16, (2**20 // max(k, 1)) // 16 * 16)
    for r0 in range(0, n, step):
        r1 = min(n, r0 + step)
        q, scale, minv = q4k_fields(blocks[r0:r1])
        qmma[r0 // 16 : r1 // 16] = shuffle_w4(pack_int4(q), group_size=G32)
        scales[r0:r1] = scale.to(dtype)
        mins[r0:r1] = minv.to(dtype)
    return qmma, scales, mins
