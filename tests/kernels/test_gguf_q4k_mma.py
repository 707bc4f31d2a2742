"""GGUF Q4_K weights converted for the int4 MMA (kernels/gguf_q4k_mma.py): the conversion
keeps every weight (against the blocks' dequantisation), and the MMA's product with groups of
32 columns and float mins matches x @ w.T. In the interpreter the kernel's `EMULATE` sums
run; on a GPU the inline PTX MMAs do."""

from __future__ import annotations

import pytest
import torch

from kernels.gguf_blocks import dequantize_ref, random_blocks
from kernels.gguf_q4k_mma import q4k_to_mma
from kernels.w4a16 import unpack_int4
from kernels.w4a16_mma import unshuffle_w4, w4a16_mma
from tests.kernels.helpers import DEVICE


def _weights(qmma: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor) -> torch.Tensor:
    """The converted weight, fp32 [n, k]: scale * q - min per group of 32 columns."""
    q = unpack_int4(unshuffle_w4(qmma, group_size=32)).float()
    return scales.float().repeat_interleave(32, 1) * q - mins.float().repeat_interleave(32, 1)


def test_the_conversion_keeps_every_weight() -> None:
    """fp32 scales and mins: the converted weight equals the blocks' dequantisation bit for
    bit; fp16: within fp16's rounding of each sub-block's scale and min."""
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(48, 512, "Q4_K", gen)
    want = dequantize_ref(blocks, "Q4_K")
    exact = q4k_to_mma(blocks, 512, torch.float32)
    assert torch.equal(_weights(*exact), want)
    qmma, scales, mins = q4k_to_mma(blocks, 512)
    assert scales.dtype == mins.dtype == torch.float16 and scales.shape == (48, 16)
    err = (_weights(qmma, scales, mins) - want).abs()
    # half an fp16 ulp of the scale (times q <= 15) and of the min, and fp32's own rounding
    s_abs, m_abs = (t.abs().repeat_interleave(32, 1) for t in exact[1:])
    bound = 2**-11 * (15 * s_abs + m_abs) + 2**-22 * want.abs()
    assert bool((err <= bound).all())


@pytest.mark.parametrize("m", [1, 6, 16, 40])
def test_the_mma_multiplies_converted_q4k_weights(m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    blocks = random_blocks(32, 1024, "Q4_K", gen).to(DEVICE)
    qmma, scales, mins = q4k_to_mma(blocks, 1024)
    x = torch.randn(m, 1024, generator=gen).to(DEVICE, torch.bfloat16)
    got = w4a16_mma(x, qmma, scales, None, group_size=32, mins=mins)
    _close(got, x.float() @ _weights(qmma, scales, mins).T)


@pytest.mark.parametrize(
    ("case", "message"),
    [("dtype", "blocks must be uint8"), ("k", "for k = 512"), ("n", "multiple of 16")],
)
def test_bad_blocks_are_refused(case: str, message: str) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(24 if case == "n" else 32, 512, "Q4_K", gen)
    if case == "dtype":
        blocks = blocks.to(torch.int16)
    elif case == "k":
        blocks = blocks[:, :144]
    with pytest.raises(ValueError, match=message):
        q4k_to_mma(blocks, 512)


def test_the_expansion_and_the_routing_past_64_rows() -> None:
    """Prefill's expansion of the converted weight (kernels/w4a16_mma_dequant with groups of
    32 and mins) gives the converted weight bit for bit in fp32, and w4a16_mma_matmul routes
    65 rows through it (in slices of whole tiles) and 64 through the MMA."""
    from kernels.w4a16_matmul import w4a16_mma_matmul
    from kernels.w4a16_mma_dequant import w4a16_mma_dequantize

    gen = torch.Generator().manual_seed(5)
    blocks = random_blocks(32, 512, "Q4_K", gen).to(DEVICE)
    qmma, scales, mins = q4k_to_mma(blocks, 512)
    weights = _weights(qmma, scales, mins)
    got = w4a16_mma_dequantize(qmma, scales, None, group_size=32, dtype=torch.float32, mins=mins)
    assert torch.equal(got, weights)
    x = torch.randn(65, 512, generator=gen).to(DEVICE, torch.bfloat16)
    out = w4a16_mma_matmul(x, qmma, scales, None, group_size=32, mins=mins, chunk_elems=16 * 512)
    # past 64 rows: the product of the weight expanded to x's dtype, a slice at a time
    expanded = w4a16_mma_dequantize(qmma, scales, None, group_size=32, mins=mins)
    _close(out, x.float() @ expanded.float().T)
    out = w4a16_mma_matmul(x[:64], qmma, scales, None, group_size=32, mins=mins)
    _close(out, x[:64].float() @ weights.T)


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    """fp32 sums in another order, one rounding to bf16: within two of bf16's roundings of
    the row's largest output."""
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    assert ((got.float() - want).abs() / scale).max().item() <= 2 * 2**-8
