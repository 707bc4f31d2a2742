"""store_kv against KVPool-style indexing: exact copies, casts to the pool dtype, views."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_kv import FP8_FORMATS, gather_kv
from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import (
    ALL_DTYPES,
    DEVICE,
    EXACT_CAST,
    FP8_KV_DTYPES,
    assert_same_bits,
    poison,
    randn,
)


@pytest.mark.parametrize("pool_dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_kv_heads", "head_dim"), [(1, 1, 64), (7, 2, 13), (20, 8, 128), (3, 4, 80)]
)
def test_matches_reference(
    num_tokens: int, num_kv_heads: int, head_dim: int, pool_dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    num_slots = 2 * num_tokens + 5
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    v = randn(num_tokens, num_kv_heads, head_dim, dtype=torch.float32, gen=gen)
    loc = torch.randperm(num_slots, generator=gen)[:num_tokens].to(DEVICE)
    k_buf = poison(torch.empty(num_slots, num_kv_heads, head_dim, dtype=pool_dtype, device=DEVICE))
    v_buf = poison(torch.empty_like(k_buf))
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv(k=k, v=v, k_buffer=k_buf, v_buffer=v_buf, out_cache_loc=loc)
    store_kv_ref(k=k, v=v, k_buffer=k_ref, v_buffer=v_ref, out_cache_loc=loc)
    # The same cast of the same values; untouched slots stay NaN in both.
    torch.testing.assert_close(k_buf, k_ref, equal_nan=True, **EXACT_CAST[pool_dtype])
    torch.testing.assert_close(v_buf, v_ref, equal_nan=True, **EXACT_CAST[pool_dtype])
    assert not k_buf[loc].isnan().any() and not v_buf[loc].isnan().any()


def fp8_cast_inputs(dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    """Values that exercise a cast to fp8, in `dtype`: for 16-bit dtypes every finite value
    and +-inf (the whole domain); for fp32 every midpoint between neighbouring values of
    both fp8 formats (ties), the floats just either side of each, and random magnitudes
    from 2^-30 to 2^20 (subnormals and overflows), both signs, and +-inf."""
    if dtype != torch.float32:
        every = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
        return every[~every.isnan()]
    grids = []
    for fp8 in FP8_FORMATS:
        values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float()
        grids.append(values[values.isfinite()].unique())  # sorted, -max .. max
    mids = torch.cat([(g[1:] + g[:-1]) / 2 for g in grids])
    up, down = torch.full_like(mids, float("inf")), torch.full_like(mids, -float("inf"))
    sign = torch.randint(0, 2, (4096,), generator=gen) * 2 - 1
    wide = sign * torch.exp2(torch.rand(4096, generator=gen) * 50 - 30)
    inf = torch.tensor([float("inf"), -float("inf"), 0.0, -0.0])
    return torch.cat([mids, mids.nextafter(up), mids.nextafter(down), wide, inf])


@pytest.mark.parametrize("pool_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("in_dtype", ALL_DTYPES)
def test_fp8_store_is_the_saturating_cast_bit_for_bit(
    in_dtype: torch.dtype, pool_dtype: torch.dtype
) -> None:
    """The pool gets exactly the bytes of torch's saturating cast (ties to even, clamped to
    the format's range), on the interpreter and a GPU alike."""
    gen = torch.Generator().manual_seed(7)
    values = fp8_cast_inputs(in_dtype, gen)
    num_kv_heads, head_dim = 32, 64  # one program per token: few programs, fast to interpret
    n = -(-values.numel() // (num_kv_heads * head_dim))
    k = torch.zeros(n * num_kv_heads * head_dim, dtype=in_dtype)
    k[: values.numel()] = values
    k = k.view(n, num_kv_heads, head_dim).to(DEVICE)
    v = k.flip(0).neg()  # other values in every slot, signs swapped
    num_slots = n + 5
    loc = torch.randperm(num_slots, generator=gen)[:n].to(DEVICE)
    k_buf = poison(torch.empty(num_slots, num_kv_heads, head_dim, dtype=pool_dtype, device=DEVICE))
    v_buf = poison(torch.empty_like(k_buf))
    k_ref, v_ref = k_buf.clone(), v_buf.clone()
    store_kv(k=k, v=v, k_buffer=k_buf, v_buffer=v_buf, out_cache_loc=loc)
    store_kv_ref(k=k, v=v, k_buffer=k_ref, v_buffer=v_ref, out_cache_loc=loc)
    assert_same_bits(k_buf, k_ref)
    assert_same_bits(v_buf, v_ref)
    # Saturated, never NaN or inf; untouched slots keep their poison.
    stored = gather_kv(k_buf, loc).float()
    assert stored.isfinite().all() and stored.abs().max() == FP8_FORMATS[pool_dtype].max
    untouched = torch.ones(num_slots, dtype=torch.bool)
    untouched[loc.cpu()] = False
    assert gather_kv(k_buf, untouched.to(DEVICE)).float().isnan().all()


def test_strided_views_and_int32_slots() -> None:
    """k and v as views into one fused qkv tensor, slots int32 with a stride, a pool view."""
    gen = torch.Generator().manual_seed(1)
    qkv = randn(6, 12, 16, dtype=torch.float16, gen=gen)  # 8 q heads, 2 k, 2 v
    k, v = qkv[:, 8:10], qkv[:, 10:12]
    loc = torch.tensor([9, 0, 3, 3, 4, 7, 1, 2, 5, 8, 6, 11], dtype=torch.int32, device=DEVICE)
    loc = loc[::2]  # [9, 3, 4, 1, 5, 6]
    big = poison(torch.empty(12, 4, 16, dtype=torch.float16, device=DEVICE))
    k_buf, v_buf = big[:, :2], big[:, 2:]
    store_kv(k=k, v=v, k_buffer=k_buf, v_buffer=v_buf, out_cache_loc=loc)
    torch.testing.assert_close(k_buf[loc.long()], k, rtol=0, atol=0)
    torch.testing.assert_close(v_buf[loc.long()], v, rtol=0, atol=0)
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[loc.long().cpu()] = False
    assert big[untouched.to(DEVICE)].isnan().all()


def test_no_tokens_is_a_no_op() -> None:
    buf = poison(torch.empty(4, 2, 8, device=DEVICE))
    empty = torch.empty(0, 2, 8, device=DEVICE)
    loc = torch.empty(0, dtype=torch.int64, device=DEVICE)
    store_kv(k=empty, v=empty, k_buffer=buf, v_buffer=buf, out_cache_loc=loc)
    assert buf.isnan().all()


@pytest.mark.parametrize(
    ("what", "error", "match"),
    [
        ("k_2d", ValueError, r"k must have shape \[n, kv_heads, d\]"),
        ("v_shape", ValueError, r"v must have shape"),
        ("buffer_heads", ValueError, r"k_buffer must have shape"),
        ("loc_len", ValueError, r"out_cache_loc must have shape \[n\] = \(3\)"),
        ("loc_float", TypeError, r"out_cache_loc must be one of int32, int64"),
        ("k_int", TypeError, r"k must be one of float16, bfloat16, float32"),
        ("k_last_stride", ValueError, r"k must be contiguous in its last dimension"),
        ("buffer_int8", TypeError, r"k_buffer must be one of float16, .*, float8_e4m3fn"),
        ("buffers_differ", TypeError, r"v_buffer must be one of float8_e5m2, got"),
    ],
)
def test_rejects_bad_arguments(what: str, error: type[Exception], match: str) -> None:
    k = torch.zeros(3, 2, 8, device=DEVICE)
    v = torch.zeros(3, 2, 8, device=DEVICE)
    buf = torch.zeros(5, 2, 8, device=DEVICE)
    loc = torch.arange(3, device=DEVICE)
    args = {"k": k, "v": v, "k_buffer": buf, "v_buffer": buf.clone(), "out_cache_loc": loc}
    args.update(
        {
            "k_2d": {"k": k.view(3, 16)},
            "v_shape": {"v": torch.zeros(3, 1, 8, device=DEVICE)},
            "buffer_heads": {"k_buffer": torch.zeros(5, 4, 8, device=DEVICE)},
            "loc_len": {"out_cache_loc": torch.arange(2, device=DEVICE)},
            "loc_float": {"out_cache_loc": loc.float()},
            "k_int": {"k": k.int()},
            "k_last_stride": {"k": torch.zeros(3, 8, 2, device=DEVICE).transpose(1, 2)},
            "buffer_int8": {"k_buffer": buf.to(torch.int8), "v_buffer": buf.to(torch.int8)},
            "buffers_differ": {"k_buffer": buf.to(torch.float8_e5m2)},
        }[what]
    )
    with pytest.raises(error, match=match):
        store_kv(**args)


def test_cpu_tensors_need_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    t = torch.zeros(1, 1, 8)
    loc = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match=r"store_kv: tensors are on the CPU; Triton kernels need"):
        store_kv(k=t, v=t, k_buffer=t, v_buffer=t, out_cache_loc=loc)
