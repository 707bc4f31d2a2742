"""fp8_block_gemm against its torch twin: both operands' 128-wide scales, partial blocks in
every dimension, tiles narrower and wider than a block, and the Llama-8B shapes on a GPU."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_act_quant import quantize_act
from kernels.fp8_block_gemm import fp8_block_gemm, fp8_block_gemm_ref
from kernels.fp8_weights import quantize_blocks
from tests.kernels.helpers import randn


def operands(m: int, n: int, k: int, seed: int) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    w = randn(n, k, dtype=torch.float32, gen=gen, scale=0.05)
    w *= torch.linspace(0.1, 3.0, n, device=w.device)[:, None]  # blocks of different scales
    x = randn(m, k, dtype=torch.float32, gen=gen)
    x *= torch.linspace(0.2, 5.0, k, device=x.device)[None, :]  # groups of different scales
    q, s = quantize_blocks(w)
    xq, xs = quantize_act(x, group=128)
    return xq, xs, q, s


@pytest.mark.parametrize(("block_m", "block_n"), [(16, 64), (32, 256)])
@pytest.mark.parametrize(("m", "n", "k"), [(5, 200, 300), (33, 130, 256), (1, 128, 128)])
def test_matches_reference(m: int, n: int, k: int, block_m: int, block_n: int) -> None:
    xq, xs, q, s = operands(m, n, k, seed=m + n + k)
    got = fp8_block_gemm(xq, xs, q, s, out_dtype=torch.float32, block_m=block_m, block_n=block_n)
    want = fp8_block_gemm_ref(xq, xs, q, s, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize(
    ("m", "n", "k"), [(1000, 6144, 4096), (257, 4096, 14336), (64, 28672, 4096)]
)
def test_llama_8b_shapes_in_bf16(m: int, n: int, k: int) -> None:
    xq, xs, q, s = operands(m, n, k, seed=1)
    got = fp8_block_gemm(xq, xs, q, s)
    want = fp8_block_gemm_ref(xq, xs, q, s, out_dtype=torch.float32)
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=1.6e-2)


def test_rejects_bad_arguments() -> None:
    xq, xs, q, s = operands(4, 128, 256, seed=0)
    with pytest.raises(ValueError, match=r"a_scale must have shape \[m, ceil\(k/128\)\]"):
        fp8_block_gemm(xq, xs[:, :1], q, s)
    with pytest.raises(ValueError, match=r"w_scale must have shape"):
        fp8_block_gemm(xq, xs, q, s[:, :1])
    with pytest.raises(TypeError, match="a must be one of float8_e4m3fn"):
        fp8_block_gemm(xq.float(), xs, q, s)
    with pytest.raises(ValueError, match="block_n must be a power of two"):
        fp8_block_gemm(xq, xs, q, s, block_n=100)
