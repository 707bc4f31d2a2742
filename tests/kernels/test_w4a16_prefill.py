"""int4 (w4a16) prefill: the dequantise kernel against dequantize_w4 (exact: the same fp32
arithmetic, one rounding to the output dtype), and w4a16_matmul past its GEMM rows
(dequantise a slice of rows at a time, then cuBLAS) against the torch twin w4a16_ref, alone
and inside a loaded int4 model's projections."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

import kernels.w4a16_matmul
import services.executor.quant.int4_linear as int4_linear
from kernels.gemv import MAX_M
from kernels.w4a16 import dequantize_w4
from kernels.w4a16_dequant import w4a16_dequantize
from kernels.w4a16_gemm import w4a16_gemm
from kernels.w4a16_gemv import w4a16_gemv
from kernels.w4a16_matmul import GEMM_MAX_M, w4a16_matmul
from services.executor.distributed.group import TPGroup
from services.executor.quant.int4_linear import PackedInt4
from services.executor.weights import load_model
from tests.executor.helpers import write_tiny_model
from tests.executor.test_int4_weights import FORMATS, write_int4
from tests.kernels.helpers import DEVICE, EXACT_CAST, poison, randn
from tests.kernels.test_int4_linear import int4_layers
from tests.kernels.test_w4a16 import ROUNDING, W4, assert_close_at_scale


def twin(w: W4, dtype: torch.dtype) -> torch.Tensor:
    """What w4a16_dequantize writes: dequantize_w4, with act-order padding columns 0."""
    want = dequantize_w4(w.qweight, w.scales, w.zeros, group_size=w.group_size)
    if w.perm is not None:
        want[:, w.perm < 0] = 0.0
    return want.to(dtype)


# (n, k, group_size, act_order, symmetric, scale dtype, block_n, block_w): odd n over several
# row tiles; k not a multiple of the tile (25 and 49 words) with a partial last group; tiles
# of 4 groups, of one group, and inside one group; padding columns; sym (zero point 8); the
# launcher's default tiles (None: 1 x 256 words, 2 x 128 with a perm) over 257 words
DEQUANT_CASES = [
    (13, 200, 32, False, False, torch.float16, 8, 8),
    (8, 64, 16, False, True, torch.bfloat16, 4, 2),
    (37, 392, 128, True, False, torch.float32, 16, 4),
    (3, 2056, 128, False, False, torch.float16, None, None),
    (3, 2056, 64, True, False, torch.bfloat16, None, None),
]


@pytest.mark.parametrize(
    "dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"]
)
@pytest.mark.parametrize(
    ("n", "k", "group_size", "act_order", "sym", "scale_dtype", "block_n", "block_w"),
    DEQUANT_CASES,
)
def test_dequantize_matches_its_twin(
    n: int,
    k: int,
    group_size: int,
    act_order: bool,
    sym: bool,
    scale_dtype: torch.dtype,
    block_n: int | None,
    block_w: int | None,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(n * k)
    w = W4(n, k, group_size, gen, act_order=act_order, scale_dtype=scale_dtype)
    if sym:
        w.zeros.fill_(8)
    out = poison(torch.empty(n, k + 24, dtype=dtype, device=DEVICE))[:, :k]  # row stride k + 24
    got = w4a16_dequantize(
        w.qweight, w.scales, w.zeros, group_size=group_size, dtype=dtype, perm=w.perm, out=out,
        block_n=block_n, block_w=block_w,
    )  # fmt: skip
    assert got is out
    torch.testing.assert_close(out, twin(w, dtype), **EXACT_CAST[dtype])
    if act_order:
        assert w.perm is not None and bool((out[:, w.perm < 0] == 0).all())
        assert bool((twin(w, dtype)[:, w.perm >= 0] != 0).any())


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"dtype": torch.int32}, TypeError, r"dtype must be a float dtype"),
        ({"out": torch.zeros(8, 56)}, ValueError, r"out must have shape \[n, k\]"),
        ({"out": torch.zeros(8, 64, dtype=torch.float16)}, TypeError, r"out must be one of"),
        ({"block_w": 12}, ValueError, r"block_w must be a power of two"),
        ({"group_size": 8}, ValueError, r"group_size must be a power of two from 16"),
    ],
)
def test_dequantize_rejects_bad_arguments(
    change: dict[str, Any], error: type[Exception], match: str
) -> None:
    w = W4(8, 64, 32, torch.Generator().manual_seed(0))
    kw: dict[str, Any] = {"group_size": 32, "dtype": torch.float32, **change}
    if isinstance(kw.get("out"), torch.Tensor):
        kw["out"] = kw["out"].to(DEVICE)
    with pytest.raises(error, match=match):
        w4a16_dequantize(w.qweight, w.scales, w.zeros, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("act_order", [False, True], ids=["plain", "act_order"])
def test_matmul_past_gemm_max_m_dequantizes_slices_of_rows(
    act_order: bool, dtype: torch.dtype
) -> None:
    """chunk_elems of 5 rows: 13 outputs in slices of 5, 5 and 3; x with a wider row stride;
    with act-order, x's columns gathered and padding columns adding nothing."""
    gen = torch.Generator().manual_seed(7)
    n, k, m = 13, 160, MAX_M + 3
    w = W4(n, k, 32, gen, act_order=act_order)
    x = randn(m, w.k_in + 8, dtype=dtype, gen=gen)[:, : w.k_in]
    out = poison(torch.empty(m, n, dtype=dtype, device=DEVICE))
    w4a16_matmul(
        x, w.qweight, w.scales, w.zeros, group_size=32, perm=w.perm, out=out,
        gemm_max_m=MAX_M, chunk_elems=5 * k + 7,
    )  # fmt: skip
    tol = ROUNDING[dtype]
    torch.testing.assert_close(out, w.ref(x), atol=tol, rtol=tol)


def counted(
    seen: list[tuple[str, int]], name: str, fn: Callable[..., torch.Tensor]
) -> Callable[..., torch.Tensor]:
    """fn, recording (name, rows of its first argument) at each call."""

    def wrapped(a: torch.Tensor, *args: Any, **kw: Any) -> torch.Tensor:
        seen.append((name, a.shape[0]))
        return fn(a, *args, **kw)

    return wrapped


def test_matmul_takes_the_gemv_then_the_gemm_then_dequantize_and_cublas(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """At the default GEMM_MAX_M: the GEMM up to it, one dequantised slice (of all 8 rows
    of the weight) per call past it."""
    seen: list[tuple[str, int]] = []
    mod = kernels.w4a16_matmul
    monkeypatch.setattr(mod, "w4a16_gemv", counted(seen, "gemv", w4a16_gemv))
    monkeypatch.setattr(mod, "w4a16_gemm", counted(seen, "gemm", w4a16_gemm))
    monkeypatch.setattr(mod, "w4a16_dequantize", counted(seen, "dequantize", w4a16_dequantize))
    gen = torch.Generator().manual_seed(6)
    w = W4(8, 64, 32, gen)
    rows = (1, MAX_M, MAX_M + 1, GEMM_MAX_M, GEMM_MAX_M + 1, 2 * GEMM_MAX_M)
    for m in rows:
        x = randn(m, 64, dtype=torch.float32, gen=gen)
        got = w4a16_matmul(x, w.qweight, w.scales, w.zeros, group_size=32)
        torch.testing.assert_close(got, w.ref(x), atol=1e-4, rtol=1e-4)
    assert seen == [
        ("gemv", 1),
        ("gemv", MAX_M),
        ("gemm", MAX_M + 1),
        ("gemm", GEMM_MAX_M),
        ("dequantize", 8),
        ("dequantize", 8),
    ]


@pytest.fixture(scope="module")
def act_order_rank(tmp_path_factory: pytest.TempPathFactory) -> torch.nn.Module:
    """Rank 1 of 2 of a tiny act-order GPTQ Llama, in fp32 on DEVICE: its row-parallel
    projections (o_proj, down_proj) hold runs of shared groups padded with -1 columns."""
    tmp = tmp_path_factory.mktemp("int4prefill")
    ckpt = write_int4(
        write_tiny_model(tmp, "llama", seed=3), tmp / "gptq", **FORMATS["gptq-act-order"]
    )
    model, _ = load_model(ckpt.path, str(DEVICE), torch.float32, tp=TPGroup(1, 2))
    return model


def test_a_loaded_models_projections_past_gemm_max_m_dequantize_for_the_matmul(
    act_order_rank: torch.nn.Module, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Int4Method.dense on the kernels' path (natively on a GPU, else the interpreter) past
    GEMM_MAX_M rows: each projection (fused qkv and gate_up, padded act-order perms) through
    the dequantise kernel, against x @ the dequantized weight."""
    seen: list[tuple[str, int]] = []
    monkeypatch.setattr(int4_linear, "use_kernels", lambda x: True)
    monkeypatch.setattr(
        kernels.w4a16_matmul, "w4a16_dequantize", counted(seen, "dequantize", w4a16_dequantize)
    )
    layers = int4_layers(act_order_rank)
    perms = [p.perm for p in (layer.int4 for layer in layers) if isinstance(p, PackedInt4)]
    assert len(perms) == len(layers) and any(p is not None and bool((p < 0).any()) for p in perms)
    gen = torch.Generator().manual_seed(0)
    for layer in layers:
        x = torch.randn(1, GEMM_MAX_M + 1, layer.in_features, generator=gen).to(DEVICE)
        want = x @ layer.method.dequantized(layer).T
        torch.testing.assert_close(layer.method.dense(layer, x, None), want, atol=1e-5, rtol=1e-5)
    assert seen == [("dequantize", layer.out_features) for layer in layers]


@pytest.mark.gpu
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize(("n", "k"), [(6144, 4096), (4096, 14336), (28672, 4096)])
def test_llama_8b_projection_shapes(
    n: int, k: int, act_order: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """bf16 on a GPU: the dequantised weight bit-exact, and the product past GEMM_MAX_M (gate_up
    and down in several slices of CHUNK_ELEMS) within the twin's rounding, queued without a
    host sync.

    cuBLAS may reduce bf16 products in bf16 (torch's default allows it), which at K = 14,336
    put single outputs 5 bf16 ulps from the fp32 sum on an H200: a property of cuBLAS, not of
    the dequantise path under test, so this test asks for fp32 reductions."""
    monkeypatch.setattr(torch.backends.cuda.matmul, "allow_bf16_reduced_precision_reduction", False)
    gen = torch.Generator().manual_seed(n + k)
    w = W4(n, k, 128, gen, act_order=act_order)
    got = w4a16_dequantize(w.qweight, w.scales, w.zeros, group_size=128, perm=w.perm)
    assert torch.equal(got, twin(w, torch.bfloat16))
    for m in (GEMM_MAX_M + 1, 2048):
        x = randn(m, w.k_in, dtype=torch.bfloat16, gen=gen)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")  # prefill never waits for the device
        try:
            got = w4a16_matmul(x, w.qweight, w.scales, w.zeros, group_size=128, perm=w.perm)
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert_close_at_scale(got, w.ref(x))
