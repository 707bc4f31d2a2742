"""GGUF blocks on the GPU: the torch dequantiser against the `gguf` package's own, then the
dequantise kernel, the decode GEMV and the prefill matmul against their torch twins.

The `gguf` package quantises Q8_0 (used here on random weights) but only dequantises the
K-quants, so the blocks are random bytes with finite fp16 scales (gguf_blocks.random_blocks):
every bit pattern of the packed fields is a valid block, and random bytes reach all of them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, quantize

from kernels import gguf_blocks
from kernels.gemv import MAX_M
from kernels.gguf_blocks import LAYOUTS, dequantize_ref, row_bytes
from kernels.gguf_dequant import gguf_dequantize, gguf_dequantize_ref
from kernels.gguf_gemv import gguf_gemv, gguf_gemv_ref
from kernels.gguf_matmul import gguf_matmul

from .helpers import (
    DEVICE,
    EXACT_CAST,
    assert_pdl_changes_no_bit,
    poison,
    randn,
)

QTYPES = list(LAYOUTS)


def random_blocks(n: int, k: int, qtype: str, gen: torch.Generator) -> torch.Tensor:
    return gguf_blocks.random_blocks(n, k, qtype, gen, DEVICE)


def gguf_package_dequantize(blocks: torch.Tensor, qtype: str) -> torch.Tensor:
    arr = blocks.cpu().numpy()
    return torch.from_numpy(dequantize(arr, GGMLQuantizationType[qtype]).copy())


@pytest.mark.parametrize("qtype", QTYPES)
def test_torch_dequantiser_matches_the_gguf_package_bit_for_bit(qtype: str) -> None:
    gen = torch.Generator().manual_seed(0)
    blocks = random_blocks(5, 3 * 256, qtype, gen).cpu()
    want = gguf_package_dequantize(blocks, qtype)
    got = dequantize_ref(blocks, qtype)
    assert got.shape == (5, 768) and got.dtype == torch.float32
    assert torch.equal(got, want.reshape(5, 768))


def test_q8_0_from_the_gguf_quantiser_round_trips_within_about_half_a_step() -> None:
    """Half a step of rounding, plus the scale's own rounding to fp16 (2^-11 of it) times
    at most 127."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(6, 128, generator=gen)
    blocks = torch.from_numpy(quantize(w.numpy(), GGMLQuantizationType.Q8_0))
    assert blocks.shape == (6, row_bytes("Q8_0", 128))
    step = w.reshape(6, 4, 32).abs().amax(-1, keepdim=True) / 127
    err = (dequantize_ref(blocks, "Q8_0").reshape(6, 4, 32) - w.reshape(6, 4, 32)).abs()
    assert bool((err <= step * (0.5 + 127 * 2**-11)).all())


# (n, k, block_n, groups): one block, several (super-)blocks, odd row counts, tiles that
# overhang the rows and the groups
DEQUANT_SHAPES = [(1, 256, 16, 16), (13, 512, 8, 4), (7, 768, 4, 32)]


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("n", "k", "block_n", "groups"), DEQUANT_SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_dequantize_kernel_matches_its_twin(
    qtype: str, n: int, k: int, block_n: int, groups: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(n * k)
    blocks = random_blocks(n, k, qtype, gen)
    out = poison(torch.empty(n, k + 9, dtype=dtype, device=DEVICE))[:, :k]  # row stride k + 9
    gguf_dequantize(blocks, qtype=qtype, k=k, dtype=dtype, out=out, block_n=block_n, groups=groups)
    want = gguf_dequantize_ref(blocks, qtype=qtype, dtype=dtype)
    torch.testing.assert_close(out, want, **EXACT_CAST[dtype])


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("m", range(1, MAX_M + 1))
def test_gemv_matches_its_twin_for_every_row_count(qtype: str, m: int) -> None:
    """19 outputs (not a multiple of block_n), 3 super-blocks a row, block_k not dividing k."""
    gen = torch.Generator().manual_seed(m)
    n, k = 19, 768
    blocks = random_blocks(n, k, qtype, gen)
    x = randn(m, k, dtype=torch.float32, gen=gen)
    out = poison(torch.empty(m, n, dtype=torch.float32, device=DEVICE))
    gguf_gemv(x, blocks, qtype=qtype, out=out, block_n=8, block_k=512)
    torch.testing.assert_close(out, gguf_gemv_ref(x, blocks, qtype=qtype), atol=1e-4, rtol=1e-4)


def test_every_gemv_configuration_choose_gemv_may_pick() -> None:
    """Each type's candidates (services/executor/quant/gguf_linear.py) against the twin, a row
    count each in turn: rows not a multiple of block_n, and one block past block_k, so that
    the last step runs almost empty (its blocks re-read the row's last one against zeros)."""
    from services.executor.quant.gguf_linear import GGUF_CANDIDATES

    gen = torch.Generator().manual_seed(7)
    for qtype, configs in GGUF_CANDIDATES.items():
        elems = LAYOUTS[qtype].elems
        for i, c in enumerate(configs):
            m, n, k = 1 + i % MAX_M, c.block_n + 3, c.block_k + elems
            blocks = random_blocks(n, k, qtype, gen)
            x = randn(m, k, dtype=torch.float32, gen=gen)
            got = gguf_gemv(
                x, blocks, qtype=qtype, block_n=c.block_n, block_k=c.block_k,
                num_warps=c.num_warps, num_stages=c.num_stages,
            )  # fmt: skip
            want = gguf_gemv_ref(x, blocks, qtype=qtype)
            torch.testing.assert_close(got, want, atol=2e-4, rtol=1e-4, msg=f"{qtype} {c}")


def test_gemv_rejects_q4_k_blocks_off_word_alignment() -> None:
    """Q4_K is read as 4-byte words (kernels/gguf_gemv.py); Q6_K and Q8_0 as halfwords."""
    gen = torch.Generator().manual_seed(8)
    blocks = random_blocks(2, 256, "Q4_K", gen)
    wide = torch.zeros(2, 146, dtype=torch.uint8, device=DEVICE)
    wide[:, 2:] = blocks
    x = torch.zeros(1, 256, device=DEVICE)
    with pytest.raises(ValueError, match="4-byte words"):
        gguf_gemv(x, wide[:, 2:], qtype="Q4_K")


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_in_bf16_with_strided_x_and_out(qtype: str) -> None:
    gen = torch.Generator().manual_seed(11)
    n, k = 10, 512
    blocks = random_blocks(n, k, qtype, gen)
    x = randn(3, k + 64, dtype=torch.bfloat16, gen=gen)[:, :k]
    out = poison(torch.empty(3, n + 6, dtype=torch.bfloat16, device=DEVICE))[:, :n]
    gguf_gemv(x, blocks, qtype=qtype, out=out, block_n=4, block_k=256)
    torch.testing.assert_close(out, gguf_gemv_ref(x, blocks, qtype=qtype), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("qtype", QTYPES)
def test_matmul_past_the_gemv_expands_slices_of_rows(qtype: str) -> None:
    """chunk_elems of 5 rows: 13 outputs in slices of 5, 5 and 3."""
    gen = torch.Generator().manual_seed(5)
    n, k, m = 13, 512, MAX_M + 3
    blocks = random_blocks(n, k, qtype, gen)
    x = randn(m, k, dtype=torch.float32, gen=gen)
    out = poison(torch.empty(m, n, dtype=torch.float32, device=DEVICE))
    gguf_matmul(x, blocks, qtype=qtype, out=out, chunk_elems=5 * k + 7)
    torch.testing.assert_close(out, gguf_gemv_ref(x, blocks, qtype=qtype), atol=1e-4, rtol=1e-4)


def test_matmul_takes_the_gemv_then_cublas(monkeypatch: pytest.MonkeyPatch) -> None:
    import kernels.gguf_matmul

    seen: list[tuple[str, int]] = []

    def counted(name: str, fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
        def wrapped(*args: Any, **kw: Any) -> torch.Tensor:
            seen.append((name, args[0].shape[0]))
            return fn(*args, **kw)

        return wrapped

    monkeypatch.setattr(kernels.gguf_matmul, "gguf_gemv", counted("gemv", gguf_gemv))
    monkeypatch.setattr(kernels.gguf_matmul, "gguf_dequantize", counted("expand", gguf_dequantize))
    gen = torch.Generator().manual_seed(6)
    blocks = random_blocks(4, 64, "Q8_0", gen)
    for m in (1, MAX_M, MAX_M + 1, 8):
        x = randn(m, 64, dtype=torch.float32, gen=gen)
        got = gguf_matmul(x, blocks, qtype="Q8_0")
        # the GEMV sums x * (384 + q) and takes the offset off per block: in fp32 a few
        # bits short of the twin's exact products
        want = gguf_gemv_ref(x, blocks, qtype="Q8_0")
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the expansion is called with the weight's blocks (4 rows, one slice a call)
    assert seen == [("gemv", 1), ("gemv", MAX_M), ("expand", 4), ("expand", 4)]


@pytest.mark.parametrize(
    ("qtype", "k", "nbytes", "error", "match"),
    [
        ("Q5_K", 256, 176, ValueError, r"Q5_K.*supported: Q8_0, Q4_K, Q6_K"),
        ("Q4_K", 128, 72, ValueError, r"multiples of 256 weights"),
        ("Q6_K", 256, 208, ValueError, r"blocks must have shape \[n, k / 256 \* 210\]"),
    ],
)
def test_rejects_bad_blocks(
    qtype: str, k: int, nbytes: int, error: type[Exception], match: str
) -> None:
    x = torch.zeros(1, k, device=DEVICE)
    blocks = torch.zeros(3, nbytes, dtype=torch.uint8, device=DEVICE)
    with pytest.raises(error, match=match):
        gguf_gemv(x, blocks, qtype=qtype)
    with pytest.raises(error, match=match):
        gguf_dequantize(blocks, qtype=qtype, k=k)


@pytest.mark.gpu
@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize(("n", "k"), [(4096, 4096), (1027, 14336), (6144, 4096)])
def test_real_shapes_in_bf16(qtype: str, n: int, k: int) -> None:
    """Llama-3.1-8B's projections (and an odd row count): every row count of the GEMV, a
    decode batch and a prefill through cuBLAS, and the dequantised weight, each against the
    torch twins."""
    gen = torch.Generator().manual_seed(n + k)
    blocks = random_blocks(n, k, qtype, gen)
    want_w = gguf_dequantize_ref(blocks, qtype=qtype, dtype=torch.bfloat16)
    got_w = gguf_dequantize(blocks, qtype=qtype, k=k)
    torch.testing.assert_close(got_w, want_w, atol=0.0, rtol=0.0)
    for m in (*range(1, MAX_M + 1), 5, 64, 256, 300):
        x = randn(m, k, dtype=torch.bfloat16, gen=gen)
        want = gguf_gemv_ref(x, blocks, qtype=qtype).float()
        got = gguf_matmul(x, blocks, qtype=qtype).float()
        # bf16 rounding of the output plus, past MAX_M, of the weights cuBLAS multiplies
        scale = want.abs().amax()
        torch.testing.assert_close(got, want, atol=2e-2 * float(scale), rtol=2e-2, msg=f"m={m}")


@pytest.mark.gpu
def test_a_decode_chain_gives_the_same_bits_with_and_without_pdl(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The GEMV and the GEMM launch with programmatic dependent launch (kernels/pdl.py) in
    a chain of projections each reading the one before's output, eagerly and graphed."""
    from kernels.pdl import pdl_enabled

    if not pdl_enabled(DEVICE):
        pytest.skip("PDL needs compute capability 9.0 or newer")
    gen = torch.Generator().manual_seed(3)
    weights = [(random_blocks(1024, 1024, q, gen), q) for q in ("Q4_K", "Q6_K", "Q8_0")]

    def chain(x: torch.Tensor) -> torch.Tensor:
        for blocks, qtype in weights:
            x = gguf_matmul(x, blocks, qtype=qtype) * 0.05  # keeps the values in range
        return x

    for m in (2, 24):
        assert_pdl_changes_no_bit(chain, randn(m, 1024, dtype=torch.bfloat16, gen=gen), monkeypatch)
