"""Rotary embedding: the cos/sin cache against the model's RotaryEmbedding, the kernel against
its torch twin and the model's apply_rotary."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.rotary import KVStore, QKNorm, apply_rotary, apply_rotary_ref, build_cos_sin_cache
from services.executor.models import layers
from services.executor.models.gemma import GemmaRMSNorm
from tests.executor.helpers import LLAMA3_ROPE, longrope
from tests.kernels.helpers import ALL_DTYPES, DEVICE, TOLERANCES, Tol, randn

# fp32 math rounded once on both sides; a GPU may fuse x1 * cos - x2 * sin into one FMA,
# so allow one ulp of the output dtype.
ONE_ULP: dict[torch.dtype, Tol] = {
    torch.float32: TOLERANCES[torch.float32],
    torch.float16: {"atol": 1e-6, "rtol": 2**-10},
    torch.bfloat16: {"atol": 1e-6, "rtol": 2**-7},
}

SCALINGS = [
    pytest.param(None, id="plain"),
    pytest.param({"rope_type": "linear", "factor": 4.0}, id="linear"),
    pytest.param(LLAMA3_ROPE, id="llama3"),
]
# LongRoPE with an original context of 64 (the caches here serve 4096: long factors) and an
# attention factor that scales cos and sin.
LONGROPE = {**longrope(rotary_dim=64, original=64), "attention_factor": 1.25}


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_cache_matches_the_model(head_dim: int, scaling: dict[str, Any] | None) -> None:
    cache = build_cos_sin_cache(
        head_dim=head_dim, theta=500000.0, scaling=scaling, max_positions=4096, device=DEVICE
    )
    rotary = layers.RotaryEmbedding(head_dim, 500000.0, scaling, 4096)
    positions = torch.tensor([0, 1, 2, 63, 64, 1000, 4095], device=DEVICE)
    cos, sin = rotary(positions)
    half = head_dim // 2
    assert cache.shape == (4096, head_dim) and cache.dtype == torch.float32
    torch.testing.assert_close(cache[positions, :half], cos[:, :half], rtol=0, atol=0)
    torch.testing.assert_close(cache[positions, half:], sin[:, :half], rtol=0, atol=0)


def test_longrope_cache_matches_the_model_and_takes_the_long_factors() -> None:
    served = {
        n: build_cos_sin_cache(
            head_dim=64, theta=10000.0, scaling=LONGROPE, max_positions=n, device=DEVICE
        )
        for n in (64, 4096)
    }
    positions = torch.tensor([0, 1, 63], device=DEVICE)
    for n, cache in served.items():
        cos, sin = layers.RotaryEmbedding(64, 10000.0, LONGROPE, n)(positions)
        torch.testing.assert_close(cache[positions, :32], cos[:, :32], rtol=0, atol=0)
        torch.testing.assert_close(cache[positions, 32:], sin[:, :32], rtol=0, atol=0)
    # Position 1's angles: inv_freq over the short factors within the original context,
    # over the long ones past it; both scaled by the attention factor.
    exponents = torch.arange(0, 64, 2).float() / 64
    for n, key in ((64, "short_factor"), (4096, "long_factor")):
        inv_freq = 1.0 / (torch.tensor(LONGROPE[key]) * 10000.0**exponents)
        want = torch.cat((inv_freq.cos(), inv_freq.sin())) * 1.25
        torch.testing.assert_close(served[n][1].cpu(), want)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("head_dim", "rotary_dim"), [(16, 12), (128, 96), (80, 32)])
def test_partial_rotary_leaves_the_other_dims(
    head_dim: int, rotary_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(rotary_dim)
    cache = build_cos_sin_cache(
        head_dim=rotary_dim, theta=10000.0, scaling=None, max_positions=128, device=DEVICE
    )
    q = randn(5, 4, head_dim, dtype=dtype, gen=gen)
    k = randn(5, 2, head_dim, dtype=dtype, gen=gen)
    positions = torch.tensor([0, 3, 64, 127, 9], device=DEVICE)
    q0, k0 = q.clone(), k.clone()
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(q=q, k=k, positions=positions, cos_sin_cache=cache)
    apply_rotary_ref(q=q_ref, k=k_ref, positions=positions, cos_sin_cache=cache)
    torch.testing.assert_close(q, q_ref, **ONE_ULP[dtype])
    torch.testing.assert_close(k, k_ref, **ONE_ULP[dtype])
    assert torch.equal(q[..., rotary_dim:], q0[..., rotary_dim:])
    assert torch.equal(k[..., rotary_dim:], k0[..., rotary_dim:])
    assert not torch.equal(q[1:, :, :rotary_dim], q0[1:, :, :rotary_dim])
    if dtype == torch.float32:  # the model's CPU path rotates the same dims the same way
        cos, sin = layers.RotaryEmbedding(rotary_dim, 10000.0, None, 128)(positions)
        torch.testing.assert_close(layers.apply_rotary(q0, cos, sin), q, **ONE_ULP[dtype])


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim"),
    [(1, 4, 4, 64), (3, 8, 2, 80), (8, 8, 1, 128), (5, 12, 4, 96), (4, 2, 2, 14)],
)
def test_matches_reference(
    num_tokens: int, num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(num_tokens * 100 + head_dim)
    cache = build_cos_sin_cache(
        head_dim=head_dim, theta=10000.0, scaling=LLAMA3_ROPE, max_positions=512, device=DEVICE
    )
    q = randn(num_tokens, num_heads, head_dim, dtype=dtype, gen=gen)
    k = randn(num_tokens, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    positions = torch.randint(0, 512, (num_tokens,), generator=gen).to(DEVICE)
    q_ref, k_ref = q.clone(), k.clone()
    apply_rotary(q=q, k=k, positions=positions, cos_sin_cache=cache)
    apply_rotary_ref(q=q_ref, k=k_ref, positions=positions, cos_sin_cache=cache)
    torch.testing.assert_close(q, q_ref, **ONE_ULP[dtype])
    torch.testing.assert_close(k, k_ref, **ONE_ULP[dtype])


def test_matches_the_model_in_fp32() -> None:
    gen = torch.Generator().manual_seed(1)
    cache = build_cos_sin_cache(
        head_dim=64, theta=10000.0, scaling=None, max_positions=300, device=DEVICE
    )
    positions = torch.tensor([0, 5, 299, 17], device=DEVICE)
    q = randn(4, 4, 64, dtype=torch.float32, gen=gen)
    k = randn(4, 2, 64, dtype=torch.float32, gen=gen)
    cos, sin = layers.RotaryEmbedding(64, 10000.0, None, 300)(positions)
    want_q, want_k = layers.apply_rotary(q, cos, sin), layers.apply_rotary(k, cos, sin)
    apply_rotary(q=q, k=k, positions=positions, cos_sin_cache=cache)
    torch.testing.assert_close(q, want_q, **TOLERANCES[torch.float32])
    torch.testing.assert_close(k, want_k, **TOLERANCES[torch.float32])


def test_views_of_a_fused_qkv_tensor() -> None:
    """q and k rotated in place inside qkv; v, beside them, untouched."""
    gen = torch.Generator().manual_seed(2)
    cache = build_cos_sin_cache(
        head_dim=32, theta=10000.0, scaling=None, max_positions=64, device=DEVICE
    )
    qkv = randn(6, 4 + 2 + 2, 32, dtype=torch.float16, gen=gen)
    before = qkv.clone()
    positions = torch.arange(10, 16, device=DEVICE, dtype=torch.int32)
    apply_rotary(q=qkv[:, :4], k=qkv[:, 4:6], positions=positions, cos_sin_cache=cache)
    q_ref, k_ref = before[:, :4].clone(), before[:, 4:6].clone()
    apply_rotary_ref(q=q_ref, k=k_ref, positions=positions, cos_sin_cache=cache)
    torch.testing.assert_close(qkv[:, :4], q_ref, **ONE_ULP[torch.float16])
    torch.testing.assert_close(qkv[:, 4:6], k_ref, **ONE_ULP[torch.float16])
    torch.testing.assert_close(qkv[:, 6:], before[:, 6:], rtol=0, atol=0)


@pytest.mark.parametrize(
    ("what", "error", "match"),
    [
        ("odd_dim", ValueError, r"head_dim must be even"),
        ("k_dtype", TypeError, r"k must be one of float32"),
        ("k_dim", ValueError, r"k must have shape \[n, kv_heads, d\] = \(3, \*, 8\)"),
        ("positions", ValueError, r"positions must have shape \[n\] = \(3\)"),
        ("cache_dtype", TypeError, r"cos_sin_cache must be one of float32"),
        ("cache_width", ValueError, r"rotary_dim must be even and in \(0, head_dim = 8\], got 10"),
        ("cache_odd", ValueError, r"rotary_dim must be even and in \(0, head_dim = 8\], got 5"),
    ],
)
def test_rejects_bad_arguments(what: str, error: type[Exception], match: str) -> None:
    args = {
        "q": torch.zeros(3, 2, 8),
        "k": torch.zeros(3, 1, 8),
        "positions": torch.zeros(3, dtype=torch.int64),
        "cos_sin_cache": torch.zeros(16, 8),
    }
    args.update(
        {
            "odd_dim": {"q": torch.zeros(3, 2, 7), "k": torch.zeros(3, 1, 7)},
            "k_dtype": {"k": torch.zeros(3, 1, 8, dtype=torch.float16)},
            "k_dim": {"k": torch.zeros(3, 1, 6)},
            "positions": {"positions": torch.zeros(4, dtype=torch.int64)},
            "cache_dtype": {"cos_sin_cache": torch.zeros(16, 8, dtype=torch.float16)},
            "cache_width": {"cos_sin_cache": torch.zeros(16, 10)},
            "cache_odd": {"cos_sin_cache": torch.zeros(16, 5)},
        }[what]
    )
    with pytest.raises(error, match=match):
        apply_rotary(
            q=args["q"].to(DEVICE),
            k=args["k"].to(DEVICE),
            positions=args["positions"].to(DEVICE),
            cos_sin_cache=args["cos_sin_cache"].to(DEVICE),
        )


def head_norms(head_dim: int, unit_offset: bool, dtype: torch.dtype, gen: torch.Generator) -> Any:
    """q and k norms as the models hold them (Qwen3's RMSNorm, Gemma's GemmaRMSNorm), with
    random weights."""
    norms = []
    for _ in range(2):
        norm = GemmaRMSNorm(head_dim, 1e-6) if unit_offset else layers.RMSNorm(head_dim, 1e-6)
        with torch.no_grad():
            norm.weight.copy_(
                torch.randn(head_dim, generator=gen) * 0.5 + (0 if unit_offset else 1)
            )
        norms.append(norm.to(device=DEVICE, dtype=dtype))
    return norms[0], norms[1]


@pytest.mark.parametrize("unit_offset", [False, True], ids=["qwen3", "gemma"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("num_tokens", "num_heads", "num_kv_heads", "head_dim", "rotary_dim"),
    [(1, 4, 4, 64, 64), (3, 8, 2, 128, 128), (5, 6, 2, 80, 48)],
)
def test_head_norm_fused_before_rotation(
    num_tokens: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    rotary_dim: int,
    dtype: torch.dtype,
    unit_offset: bool,
) -> None:
    """Each head normed, then rotated, in one launch: as the models' own norm modules and
    rotation compute it, q and k views of one fused qkv tensor, v untouched; the dims past
    rotary_dim normed and not rotated."""
    gen = torch.Generator().manual_seed(head_dim + num_tokens)
    cache = build_cos_sin_cache(
        head_dim=rotary_dim, theta=10000.0, scaling=None, max_positions=256, device=DEVICE
    )
    qkv = randn(num_tokens, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, gen=gen) * 3
    before = qkv.clone()
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    qn, kn = head_norms(head_dim, unit_offset, dtype, gen)
    positions = torch.randint(0, 256, (num_tokens,), generator=gen).to(DEVICE)
    norm = QKNorm(qn.weight.detach(), kn.weight.detach(), 1e-6, unit_offset)
    apply_rotary(q=q, k=k, positions=positions, cos_sin_cache=cache, norm=norm)
    # the twin: the model's norm modules on the CPU path, then the reference rotation
    with torch.no_grad():
        q_ref = qn(before[:, :num_heads])
        k_ref = kn(before[:, num_heads : num_heads + num_kv_heads])
    assert q_ref.dtype == dtype
    apply_rotary_ref(q=q_ref, k=k_ref, positions=positions, cos_sin_cache=cache)
    # The kernel's 1/sqrt and torch's rsqrt may differ in fp32's last bit, which can round a
    # normed value one ulp of x's dtype apart; the rotation then adds two such values, so
    # the bound is a few ulps at the largest magnitude (exact in fp32 up to its own ulps).
    for got, want in ((q, q_ref), (k, k_ref)):
        ulp = torch.finfo(dtype).eps * float(want.float().abs().max())
        torch.testing.assert_close(got.float(), want.float(), atol=4 * ulp, rtol=0)
    torch.testing.assert_close(
        qkv[:, num_heads + num_kv_heads :], before[:, num_heads + num_kv_heads :], rtol=0, atol=0
    )
    # the norm did something the rotation alone does not
    plain_q = before[:, :num_heads].clone()
    plain_k = before[:, num_heads : num_heads + num_kv_heads].clone()
    apply_rotary_ref(q=plain_q, k=plain_k, positions=positions, cos_sin_cache=cache)
    assert not torch.allclose(q.float(), plain_q.float(), atol=1e-2)


def test_rope_apply_fuses_the_head_norms_as_its_cpu_path_computes_them() -> None:
    """layers.Rope.apply with norms: the CUDA form (cos/sin cache, one kernel) against the CPU
    form (the norm modules, then the model's apply_rotary) in fp32."""
    gen = torch.Generator().manual_seed(7)
    qn, kn = head_norms(64, False, torch.float32, gen)
    positions = torch.tensor([0, 9, 100], device=DEVICE)
    cache = build_cos_sin_cache(
        head_dim=64, theta=10000.0, scaling=None, max_positions=128, device=DEVICE
    )
    cos, sin = layers.RotaryEmbedding(64, 10000.0, None, 128)(positions)
    q = randn(3, 4, 64, dtype=torch.float32, gen=gen)
    k = randn(3, 2, 64, dtype=torch.float32, gen=gen)
    with torch.no_grad():
        want_q, want_k = layers.Rope(positions, cos, sin, None).apply(q, k, (qn, kn))
        got_q, got_k = layers.Rope(positions, None, None, cache).apply(
            q.clone(), k.clone(), (qn, kn)
        )
    torch.testing.assert_close(got_q, want_q, **TOLERANCES[torch.float32])
    torch.testing.assert_close(got_k, want_k, **TOLERANCES[torch.float32])


def test_rejects_a_head_norm_of_the_wrong_width() -> None:
    norm = QKNorm(torch.ones(6, device=DEVICE), torch.ones(8, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match=r"norm.q_weight must have shape \[d\] = \(8\)"):
        apply_rotary(
            q=torch.zeros(3, 2, 8, device=DEVICE),
            k=torch.zeros(3, 1, 8, device=DEVICE),
            positions=torch.zeros(3, dtype=torch.int64, device=DEVICE),
            cos_sin_cache=torch.zeros(16, 8, device=DEVICE),
            norm=norm,
        )


@pytest.mark.parametrize("normed", [False, True], ids=["plain", "qk-norm"])
@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(("num_kv_heads", "head_dim", "rotary_dim"), [(2, 64, 64), (3, 80, 48)])
def test_store_writes_the_rotated_k_and_v_to_their_slots(
    num_kv_heads: int, head_dim: int, rotary_dim: int, dtype: torch.dtype, normed: bool
) -> None:
    """With a KVStore the same launch writes k (as rotated, the dims past rotary_dim too) and
    v into the pool at each token's slot, and nothing else of the pool."""
    gen = torch.Generator().manual_seed(num_kv_heads + head_dim)
    n, num_heads, slots = 3, 4, 9
    cache = build_cos_sin_cache(
        head_dim=rotary_dim, theta=10000.0, scaling=None, max_positions=64, device=DEVICE
    )
    qkv = randn(n, num_heads + 2 * num_kv_heads, head_dim, dtype=dtype, gen=gen)
    q, k = qkv[:, :num_heads], qkv[:, num_heads : num_heads + num_kv_heads]
    v = qkv[:, num_heads + num_kv_heads :]
    positions = torch.tensor([3, 0, 63], device=DEVICE)
    locs = torch.tensor([7, 2, 4], device=DEVICE)
    norm = None
    if normed:
        qn, kn = head_norms(head_dim, False, dtype, gen)
        norm = QKNorm(qn.weight.detach(), kn.weight.detach(), 1e-6)
    k_buf = torch.full((slots, num_kv_heads, head_dim), 5.0, dtype=dtype, device=DEVICE)
    v_buf = torch.full_like(k_buf, 5.0)
    twin = [x.clone() for x in (q, k, v, k_buf, v_buf)]
    store = KVStore(v, k_buf, v_buf, locs)
    apply_rotary(q=q, k=k, positions=positions, cos_sin_cache=cache, norm=norm, store=store)
    want = KVStore(twin[2], twin[3], twin[4], locs)
    apply_rotary_ref(
        q=twin[0], k=twin[1], positions=positions, cos_sin_cache=cache, norm=norm, store=want
    )
    assert torch.equal(k_buf[locs], k) and torch.equal(v_buf[locs], v)  # what the kernel left
    for got, ref in ((k_buf, twin[3]), (v_buf, twin[4])):
        ulp = torch.finfo(dtype).eps * float(ref.float().abs().max())
        torch.testing.assert_close(got.float(), ref.float(), atol=4 * ulp, rtol=0)
    others = [s for s in range(slots) if s not in locs.tolist()]
    assert bool((k_buf[others] == 5.0).all()) and bool((v_buf[others] == 5.0).all())


def test_store_must_match_k() -> None:
    gen = torch.Generator().manual_seed(0)
    q = randn(2, 4, 64, dtype=torch.float32, gen=gen)
    k = randn(2, 2, 64, dtype=torch.float32, gen=gen)
    cache = build_cos_sin_cache(
        head_dim=64, theta=1e4, scaling=None, max_positions=8, device=DEVICE
    )
    buf = torch.zeros(4, 2, 64, dtype=torch.float16, device=DEVICE)
    zeros = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    store = KVStore(k.clone(), buf, buf, zeros)
    with pytest.raises(TypeError, match=r"store\.k_buffer must be one of float32"):
        apply_rotary(q=q, k=k, positions=zeros, cos_sin_cache=cache, store=store)
