"""store_kv against KVPool-style indexing: exact copies, casts to the pool dtype, views."""

from __future__ import annotations

import pytest
import torch

from kernels.store_kv import store_kv, store_kv_ref
from tests.kernels.helpers import ALL_DTYPES, DEVICE, EXACT_CAST, poison, randn


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
