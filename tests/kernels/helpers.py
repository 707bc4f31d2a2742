"""Shared by the kernel tests: the device, poisoned outputs, and a KV pool whose requests own
shuffled slots among junk."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypedDict

import pytest
import torch

from kernels.fp8_kv import quantize_kv


class Tol(TypedDict):
    """Keyword arguments of torch.testing.assert_close."""

    atol: float
    rtol: float


DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRETING = DEVICE.type == "cpu"


def kernel_device(monkeypatch: pytest.MonkeyPatch, *modules: Any) -> torch.device:
    """Where a test runs the models' CUDA path (their Triton kernels): DEVICE; on the CPU,
    in Triton's interpreter, with `on_gpu` of each of `modules` patched to say yes."""
    if DEVICE.type == "cpu":
        for module in modules:
            monkeypatch.setattr(module, "on_gpu", lambda x: True)
    return DEVICE


# The Triton 3.9 interpreter computes tl.dot on bfloat16 inputs wrongly (garbage, not
# rounding), so bf16 attention runs only on a GPU; elementwise kernels test bf16 everywhere.
ALL_DTYPES = [
    pytest.param(torch.float32, id="fp32"),
    pytest.param(torch.float16, id="fp16"),
    pytest.param(torch.bfloat16, id="bf16"),
]
DOT_DTYPES = [*ALL_DTYPES[:2], pytest.param(torch.bfloat16, marks=pytest.mark.gpu, id="bf16")]

# The interpreter also rounds fp32 -> bf16 toward zero (rtne on a GPU, as torch does): where a
# kernel's cast is exact on a GPU, allow one bf16 ulp in the interpreter.
EXACT_CAST: dict[torch.dtype, Tol] = {
    torch.float32: {"atol": 0.0, "rtol": 0.0},
    torch.float16: {"atol": 0.0, "rtol": 0.0},
    torch.bfloat16: {"atol": 0.0, "rtol": 2**-7 if INTERPRETING else 0.0},
}

# fp8 KV pools (--kv-cache-dtype). The interpreter widens fp8 exactly, so attention over an
# fp8 pool runs on the CPU with fp32 and fp16 queries; bf16 queries only on a GPU, as above.
FP8_KV_DTYPES = [
    pytest.param(torch.float8_e5m2, id="e5m2"),
    pytest.param(torch.float8_e4m3fn, id="e4m3"),
]
# (query dtype, pool dtype, id); the interpreter can run the first four.
_FP8_PAIRS = [
    (torch.float32, torch.float8_e5m2, "fp32-e5m2"),
    (torch.float32, torch.float8_e4m3fn, "fp32-e4m3"),
    (torch.float16, torch.float8_e4m3fn, "fp16-e4m3"),
    (torch.float16, torch.float8_e5m2, "fp16-e5m2"),
    (torch.bfloat16, torch.float8_e5m2, "bf16-e5m2"),
    (torch.bfloat16, torch.float8_e4m3fn, "bf16-e4m3"),
]


def fp8_attention_params(cases: list[tuple[Any, ...]], ids: list[str]) -> list[Any]:
    """Each case crossed with every (query dtype, fp8 pool dtype) pair, as params of
    (*case, dtype, kv_dtype). A GPU runs the whole cross; the CPU interpreter, where the
    cross takes about 25 s, runs one CPU-capable pair per case, taking the pairs in turn so
    that both formats and both query dtypes meet several shapes."""
    out = []
    for i, (case, case_id) in enumerate(zip(cases, ids, strict=True)):
        for j, (dtype, kv_dtype, pair_id) in enumerate(_FP8_PAIRS):
            marks = () if j == i % 4 else (pytest.mark.gpu,)
            out.append(pytest.param(*case, dtype, kv_dtype, marks=marks, id=f"{case_id}-{pair_id}"))
    return out


def spread_params(
    cases: list[tuple[Any, ...]], dtypes: list[Any], ids: list[str] | None = None
) -> list[Any]:
    """Each case crossed with every param of `dtypes` (pytest.params: dtypes such as
    ALL_DTYPES' or DOT_DTYPES', or head configurations), as params of (*case, *param): a GPU
    runs the whole cross; the CPU interpreter, where each run costs seconds, one of the params
    it can run a case (those not marked gpu), taken in turn and shifted by one every round of
    them, so that cases made as a cross of that many shapes by row counts give every shape
    every param. ids: the cases' (default: their values)."""
    cpu = [j for j, d in enumerate(dtypes) if not any(m.name == "gpu" for m in d.marks)]
    out = []
    for i, case in enumerate(cases):
        on_cpu = cpu[(i + i // len(cpu)) % len(cpu)]
        for j, dtype in enumerate(dtypes):
            marks = () if j == on_cpu else (pytest.mark.gpu,)
            case_id = ids[i] if ids else "-".join(map(str, case))
            out.append(pytest.param(*case, *dtype.values, marks=[*dtype.marks, *marks],
                                    id=f"{case_id}-{dtype.id}"))  # fmt: skip
    return out


TOLERANCES: dict[torch.dtype, Tol] = {
    torch.float32: {"atol": 2e-5, "rtol": 2e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def assert_same_bits(got: torch.Tensor, want: torch.Tensor) -> None:
    """Equal bytes (NaNs included), for any dtype: assert_close has no fp8 support."""
    assert got.dtype == want.dtype and got.shape == want.shape
    same = got.view(torch.uint8) == want.view(torch.uint8)
    assert bool(same.all()), f"{int((~same).sum())} bytes differ"


def poison(t: torch.Tensor) -> torch.Tensor:
    """Fill a float tensor with NaN so that elements a kernel fails to write fail the
    comparison; returns t. fp8 gets byte 0x7f, NaN in both formats (written as bytes, as
    fp8 fill kernels are missing from some torch builds)."""
    if t.dtype in (torch.float8_e5m2, torch.float8_e4m3fn):
        t.view(torch.uint8).fill_(0x7F)
        return t
    return t.fill_(float("nan"))


def randn(
    *shape: int, dtype: torch.dtype, gen: torch.Generator, scale: float = 1.0
) -> torch.Tensor:
    """Random normal on the CPU generator, then moved: the same values on any device."""
    return (torch.randn(*shape, generator=gen) * scale).to(dtype=dtype, device=DEVICE)


@dataclass
class Context:
    """One layer's pool plus a slot table: request b owns the shuffled slots
    req_to_token[req_rows[b], :seq_lens[b]]; every other slot holds large junk."""

    k_buffer: torch.Tensor  # [num_slots, num_kv_heads, head_dim]
    v_buffer: torch.Tensor
    req_to_token: torch.Tensor  # [max_reqs, max_context]
    req_rows: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64


def make_context(
    seq_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    *,
    table_dtype: torch.dtype = torch.int64,
    kv_dtype: torch.dtype | None = None,
) -> Context:
    """kv_dtype: the pool's dtype when it is not `dtype` (fp8: values quantised by the
    pool's cast, so kernel and reference read the same bytes)."""
    total = sum(seq_lens)
    num_slots = total + 7
    k_buffer = randn(num_slots, num_kv_heads, head_dim, dtype=dtype, gen=gen, scale=100.0)
    v_buffer = randn(num_slots, num_kv_heads, head_dim, dtype=dtype, gen=gen, scale=100.0)
    max_reqs = len(seq_lens) + 2
    # Unused table entries point at junk slots, so reading past seq_len shows.
    table = torch.randint(0, num_slots, (max_reqs, max(seq_lens, default=0) + 5), generator=gen)
    rows = torch.randperm(max_reqs, generator=gen)[: len(seq_lens)]
    perm = torch.randperm(num_slots, generator=gen)
    start = 0
    for row, n in zip(rows.tolist(), seq_lens, strict=True):
        own = perm[start : start + n]
        start += n
        table[row, :n] = own
        k_buffer[own.to(DEVICE)] = randn(n, num_kv_heads, head_dim, dtype=dtype, gen=gen)
        v_buffer[own.to(DEVICE)] = randn(n, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    if kv_dtype is not None:
        k_buffer, v_buffer = quantize_kv(k_buffer, kv_dtype), quantize_kv(v_buffer, kv_dtype)
    return Context(
        k_buffer=k_buffer,
        v_buffer=v_buffer,
        req_to_token=table.to(dtype=table_dtype, device=DEVICE),
        req_rows=rows.to(DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64, device=DEVICE),
    )


def assert_pdl_changes_no_bit(
    chain: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, mp: pytest.MonkeyPatch
) -> None:
    """`chain(x)` launched with PDL (kernels/pdl.py), eagerly and from a CUDA graph, equals
    the chain launched without it, bit for bit (GPU only)."""
    with_pdl = chain(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        graphed = chain(x)
    graph.replay()
    mp.setenv("RADIXSERVE_PDL", "0")
    without = chain(x)
    mp.delenv("RADIXSERVE_PDL")
    torch.cuda.synchronize()
    assert without.abs().amax() > 0, "the chain must carry values to compare"
    assert torch.equal(with_pdl, without) and torch.equal(graphed, without), f"rows={len(x)}"
