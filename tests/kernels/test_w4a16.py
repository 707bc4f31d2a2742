"""The int4 (w4a16) GEMV and GEMM against their torch twin: every decode row count, K not a
multiple of the block, partial last groups, act-order perms with padding columns, strided
rows, and bad arguments."""

from __future__ import annotations

import pytest
import torch

from kernels.gemv import MAX_M
from kernels.w4a16 import dequantize_w4, pack_int4, unpack_int4, w4a16_ref
from kernels.w4a16_gemm import w4a16_gemm
from kernels.w4a16_gemv import w4a16_gemv
from tests.kernels.helpers import ALL_DTYPES, DEVICE, DOT_DTYPES, poison, randn, spread_params

# fp32 sums in another order than the reference's, then one rounding (the GEMM also rounds
# each dequantised weight to x's dtype before the tensor cores see it)
ROUNDING = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


class W4:
    """A random weight in the layout, [n, k], and an optional act-order perm over k_in < k
    columns of x (every tenth column padding)."""

    def __init__(
        self,
        n: int,
        k: int,
        group_size: int,
        gen: torch.Generator,
        *,
        act_order: bool = False,
        scale_dtype: torch.dtype = torch.float16,
    ) -> None:
        groups = -(-k // group_size)
        self.qweight = pack_int4(torch.randint(0, 16, (n, k), generator=gen)).to(DEVICE)
        self.scales = (torch.rand(n, groups, generator=gen) * 0.02 + 0.005).to(
            dtype=scale_dtype, device=DEVICE
        )
        self.zeros = torch.randint(0, 17, (n, groups), generator=gen, dtype=torch.uint8).to(DEVICE)
        self.group_size = group_size
        self.perm: torch.Tensor | None = None
        self.k_in = k
        if act_order:
            perm = torch.full((k,), -1, dtype=torch.int32)
            real = torch.ones(k, dtype=torch.bool)
            real[::10] = False
            self.k_in = int(real.sum())
            perm[real] = torch.randperm(self.k_in, generator=gen).to(torch.int32)
            self.perm = perm.to(DEVICE)

    def ref(self, x: torch.Tensor) -> torch.Tensor:
        return w4a16_ref(
            x, self.qweight, self.scales, self.zeros, group_size=self.group_size, perm=self.perm
        )


def test_pack_round_trip_and_nibble_order() -> None:
    q = torch.arange(16).repeat(3, 2)  # [3, 32]
    words = pack_int4(q)
    assert words.dtype == torch.int32 and words.shape == (3, 4)
    # element 8i + j in bits 4j..4j+3; 15 in the top nibble makes the word negative
    assert words[0].tolist() == [0x76543210, 0xFEDCBA98 - 2**32, 0x76543210, 0xFEDCBA98 - 2**32]
    assert torch.equal(unpack_int4(words).long(), q)


def test_dequantize_uses_each_columns_group() -> None:
    q = torch.tensor([[3] * 16 + [12] * 8])  # groups of 16: [16 columns, 8 columns]
    w = dequantize_w4(
        pack_int4(q),
        torch.tensor([[0.5, 2.0]], dtype=torch.float16),
        torch.tensor([[1, 16]], dtype=torch.uint8),
        group_size=16,
    )
    assert w.tolist() == [[1.0] * 16 + [-8.0] * 8]


@pytest.mark.parametrize(
    ("m", "n", "k", "group_size", "act_order", "dtype"),
    spread_params(
        [
            (m, *shape)
            for m in range(1, MAX_M + 1)
            for shape in [(8, 64, 16, False), (37, 200, 32, True), (20, 392, 128, False)]
        ],
        ALL_DTYPES,
    ),
)
def test_gemv_matches_reference(
    m: int, n: int, k: int, group_size: int, act_order: bool, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + n + k)
    w = W4(n, k, group_size, gen, act_order=act_order)
    x = randn(m, w.k_in, dtype=dtype, gen=gen)
    out = poison(torch.empty(m, n, dtype=dtype, device=DEVICE))
    got = w4a16_gemv(
        x, w.qweight, w.scales, w.zeros, group_size=group_size, perm=w.perm, out=out, block_n=8
    )
    assert got is out
    tol = ROUNDING[dtype]
    torch.testing.assert_close(out, w.ref(x), atol=tol, rtol=tol)


@pytest.mark.parametrize(("block_k", "block_n"), [(32, 1), (128, 2), (32, 4)])
@pytest.mark.parametrize("scale_dtype", [torch.bfloat16, torch.float32])
def test_gemv_blocks_and_scale_dtypes(block_k: int, block_n: int, scale_dtype: torch.dtype) -> None:
    """K = 176: a step of one group of 32, or of 4 groups covering K partly; the last group
    is half full; tiles of 1, 2 and 4 rows (24 rows: 6 programs of 4)."""
    gen = torch.Generator().manual_seed(block_k + block_n)
    w = W4(24, 176, 32, gen, scale_dtype=scale_dtype)
    x = randn(2, 176, dtype=torch.float32, gen=gen)
    got = w4a16_gemv(
        x,
        w.qweight,
        w.scales,
        w.zeros,
        group_size=32,
        block_k=block_k,
        block_n=block_n,
    )
    torch.testing.assert_close(got, w.ref(x), atol=1e-4, rtol=1e-4)


def test_every_configuration_choose_gemv_may_pick() -> None:
    from services.executor.quant.int4_linear import INT4_CANDIDATES

    gen = torch.Generator().manual_seed(5)
    w = W4(20, 176, 32, gen, act_order=True)
    x = randn(3, w.k_in, dtype=torch.float32, gen=gen)
    for c in INT4_CANDIDATES:
        got = w4a16_gemv(
            x, w.qweight, w.scales, w.zeros, group_size=32, perm=w.perm, block_n=c.block_n,
            block_k=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
        torch.testing.assert_close(got, w.ref(x), atol=1e-4, rtol=1e-4, msg=str(c))


@pytest.mark.parametrize(
    ("m", "dtype"),
    [(1, torch.bfloat16), (3, torch.float16), (3, torch.float32)],
    ids=["m1-bf16", "m3-fp16", "m3-fp32"],
)
def test_gemv_whole_tiles(m: int, dtype: torch.dtype) -> None:
    """Rows a multiple of block_n and words of the step, no perm: the launch without masks
    (16-bit x read 8 bytes a load), for every configuration the start-up timing may pick
    (K = 4,096 in one or more steps); x's rows strided as a slice of a wider tensor. Each
    dtype's read of x once, and one and several rows of x (each launch runs every pair in
    the interpreter, so the pairs are spread rather than crossed)."""
    from services.executor.quant.int4_linear import INT4_CANDIDATES

    gen = torch.Generator().manual_seed(40 + m)
    w = W4(16, 4096, 128, gen)
    x = randn(m, 4096 + 64, dtype=dtype, gen=gen)[:, 32 : 32 + 4096]
    tol = ROUNDING[dtype]
    for c in INT4_CANDIDATES:
        got = w4a16_gemv(
            x, w.qweight, w.scales, w.zeros, group_size=128, block_n=c.block_n,
            block_k=c.block_k, num_warps=c.num_warps, num_stages=c.num_stages,
        )  # fmt: skip
        torch.testing.assert_close(got, w.ref(x), atol=tol, rtol=tol, msg=str(c))


@pytest.mark.parametrize("magnitude", [1e-12, 1e-3, 3e4, 1e12])
def test_gemv_keeps_x_of_any_size(magnitude: float) -> None:
    """The nibbles are multiplied as subnormal floats against x scaled up by up to 2^80:
    x from 1e-12 to 1e12 gives the reference's products to fp32 rounding, with no overflow
    and no flushed subnormals."""
    gen = torch.Generator().manual_seed(7)
    w = W4(8, 1024, 128, gen)
    x = randn(2, 1024, dtype=torch.float32, gen=gen) * magnitude
    got = w4a16_gemv(x, w.qweight, w.scales, w.zeros, group_size=128, block_k=1024, num_warps=1)
    want = w.ref(x)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, want, atol=1e-4 * magnitude, rtol=1e-4)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("m", "n", "k", "group_size", "block_k", "split", "act_order"),
    [
        (5, 40, 512, 128, 128, 1, False),  # a step a group: the sums scaled once a step
        (8, 64, 1024, 256, 256, 2, False),  # two steps a group, K split in two
        (17, 20, 384, 128, 128, 2, False),  # two tiles of rows, a split with fewer steps
        (3, 33, 200, 32, 128, 1, True),  # groups shorter than a step, K partial, act-order
        (6, 24, 2048, 1024, 128, 4, True),  # act-order over long groups, four splits
    ],
)
def test_gemm_matches_reference(
    m: int,
    n: int,
    k: int,
    group_size: int,
    block_k: int,
    split: int,
    act_order: bool,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(m + n + k)
    w = W4(n, k, group_size, gen, act_order=act_order)
    x = randn(m, w.k_in, dtype=dtype, gen=gen)
    out = poison(torch.empty(m, n, dtype=dtype, device=DEVICE))
    w4a16_gemm(
        x, w.qweight, w.scales, w.zeros, group_size=group_size, perm=w.perm, out=out,
        block_m=16, block_n=16, block_k=block_k, split=split, num_warps=1,
    )  # fmt: skip
    tol = ROUNDING[dtype]
    torch.testing.assert_close(out, w.ref(x), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize("m", [20, 40, 64])
def test_gemm_default_launch_past_16_rows(m: int, dtype: torch.dtype) -> None:
    """The default tiles past 16 rows of x (one tile of 32 rows, or of 64 past 32, with the
    weight tiles default_block_n picks), against the twin."""
    gen = torch.Generator().manual_seed(m)
    w = W4(72, 1024, 128, gen)
    x = randn(m, 1024, dtype=dtype, gen=gen)
    got = w4a16_gemm(x, w.qweight, w.scales, w.zeros, group_size=128)
    tol = ROUNDING[dtype]
    torch.testing.assert_close(got, w.ref(x), atol=tol, rtol=tol)


def test_gemm_splits_sum_in_order() -> None:
    """K split across programs: the partial sums added by a second launch in a fixed order,
    so every call gives the same bits."""
    gen = torch.Generator().manual_seed(12)
    w = W4(16, 2048, 128, gen)
    x = randn(4, 2048, dtype=torch.float32, gen=gen)
    runs = [
        w4a16_gemm(x, w.qweight, w.scales, w.zeros, group_size=128, block_n=16, split=8)
        for _ in range(2)
    ]
    assert torch.equal(runs[0], runs[1])
    torch.testing.assert_close(runs[0], w.ref(x), atol=1e-4, rtol=1e-4)


def test_strided_rows_of_x_weight_and_out() -> None:
    gen = torch.Generator().manual_seed(3)
    w = W4(24, 96, 32, gen)
    # every tensor a view with a row stride wider than its row
    qweight = torch.zeros(24, 20, dtype=torch.int32, device=DEVICE)[:, :12]
    qweight.copy_(w.qweight)
    scales = torch.zeros(24, 5, dtype=torch.float16, device=DEVICE)[:, :3]
    scales.copy_(w.scales)
    zeros = torch.zeros(24, 7, dtype=torch.uint8, device=DEVICE)[:, :3]
    zeros.copy_(w.zeros)
    for m, kernel in ((3, w4a16_gemv), (17, w4a16_gemm)):
        x = randn(m, 130, dtype=torch.float32, gen=gen)[:, :96]
        out = poison(torch.empty(m, 40, dtype=torch.float32, device=DEVICE))[:, :24]
        kernel(x, qweight, scales, zeros, group_size=32, out=out)
        torch.testing.assert_close(out, w.ref(x), atol=1e-4, rtol=1e-4)


def _args(m: int = 1, k: int = 64, group_size: int = 32) -> dict[str, torch.Tensor]:
    return {
        "x": torch.zeros(m, k, device=DEVICE),
        "qweight": torch.zeros(8, 8, dtype=torch.int32, device=DEVICE),
        "scales": torch.zeros(8, 64 // group_size, dtype=torch.float16, device=DEVICE),
        "zeros": torch.zeros(8, 64 // group_size, dtype=torch.uint8, device=DEVICE),
    }


@pytest.mark.parametrize(
    ("change", "group_size", "error", "match"),
    [
        ({"x": torch.zeros(1, 72)}, 32, ValueError, r"x has 72 columns but the weight has 64"),
        ({"zeros": torch.zeros(8, 2, dtype=torch.int32)}, 32, TypeError, r"zeros must be"),
        ({"scales": torch.zeros(8, 3, dtype=torch.float16)}, 32, ValueError, r"scales must have"),
        ({"perm": torch.zeros(63, dtype=torch.int32)}, 32, ValueError, r"perm must have"),
        ({}, 48, ValueError, r"group_size must be a power of two"),
    ],
)
def test_rejects_bad_arguments(
    change: dict[str, torch.Tensor], group_size: int, error: type[Exception], match: str
) -> None:
    args = {**_args(), **{key: t.to(DEVICE) for key, t in change.items()}}
    for kernel in (w4a16_gemv, w4a16_gemm):
        with pytest.raises(error, match=match):
            kernel(
                args["x"],
                args["qweight"],
                args["scales"],
                args["zeros"],
                group_size=group_size,
                perm=args.get("perm"),
            )


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"block_k": 64}, r"block_k must be a power of two of at least 128, got 64"),
        ({"block_n": 8}, r"block_n must be a power of two >= 16, got 8"),
        ({"split": 3}, r"split must be a power of two, got 3"),
    ],
)
def test_gemm_refuses_bad_tiles(kwargs: dict[str, int], match: str) -> None:
    """Each nibble plane is a tensor-core product of K = block_k / 8 (at least 16)."""
    a = _args()
    launch = {"block_n": 16, "block_k": 128, "split": 1, **kwargs}
    with pytest.raises(ValueError, match=match):
        w4a16_gemm(
            a["x"], a["qweight"], a["scales"], a["zeros"], group_size=32,
            block_n=launch["block_n"], block_k=launch["block_k"], split=launch["split"],
        )  # fmt: skip


def test_gemv_rejects_too_many_rows() -> None:
    with pytest.raises(ValueError, match=rf"1 to {MAX_M} rows"):
        w4a16_gemv(*_args(m=MAX_M + 1).values(), group_size=32)


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ((16, 1024), "block_n must be 1, 2, 4 or 8"),
        ((8, 4), "block_k must be a power of two of at least 8"),
        ((8, 96), "block_k must be a power of two"),
    ],
)
def test_gemv_rejects_bad_tiles(change: tuple[int, int], match: str) -> None:
    """The tile's rows are spelled out in the kernel (at most 8) and its words are a power of
    two: anything else is refused with the argument's name."""
    block_n, block_k = change
    with pytest.raises(ValueError, match=match):
        w4a16_gemv(*_args().values(), group_size=32, block_n=block_n, block_k=block_k)


@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_llama_8b_projection_shapes(n: int, k: int, act_order: bool) -> None:
    gen = torch.Generator().manual_seed(n + k)
    w = W4(n, k, 128, gen, act_order=act_order)
    for m in (1, 2, MAX_M):
        x = randn(m, w.k_in, dtype=torch.bfloat16, gen=gen)
        got = w4a16_gemv(x, w.qweight, w.scales, w.zeros, group_size=128, perm=w.perm)
        assert_close_at_scale(got, w.ref(x))
    for m in (5, 300, 2048):
        x = randn(m, w.k_in, dtype=torch.bfloat16, gen=gen)
        got = w4a16_gemm(x, w.qweight, w.scales, w.zeros, group_size=128, perm=w.perm)
        assert_close_at_scale(got, w.ref(x))


def assert_close_at_scale(got: torch.Tensor, want: torch.Tensor) -> None:
    """Within 1% of the outputs' RMS. The kernels round each dequantised weight to the
    activations' dtype (bf16 here, for the tensor cores) and the fp32 reference does not, so
    over K terms the difference grows like sqrt(K) times the outputs' own scale (on an H200:
    0.09 at K = 14,336), where a fixed atol fits only one K."""
    rms = float(want.float().pow(2).mean().sqrt())
    torch.testing.assert_close(got, want, atol=1e-2 * rms, rtol=1.6e-2)
