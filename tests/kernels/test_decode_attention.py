"""decode_attention against its torch twin: GQA groups, odd head dims, split-K chunking."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from kernels.decode_attention import (
    DecodeWorkspace,
    choose_kv_pack,
    decode_attention,
    decode_attention_ref,
    num_kv_splits_for,
)
from kernels.fp8_kv import quantize_kv
from tests.kernels.helpers import (
    DEVICE,
    DOT_DTYPES,
    FP8_KV_DTYPES,
    TOLERANCES,
    Context,
    fp8_attention_params,
    make_context,
    poison,
    randn,
)


def run(
    ctx: Context,
    q: torch.Tensor,
    splits: torch.Tensor,
    *,
    max_kv_splits: int,
    block_n: int | None = None,
    out: torch.Tensor | None = None,
    kv_pack: int | None = None,
    **widening: bool,
) -> torch.Tensor:
    bs, num_heads, head_dim = q.shape
    # A workspace larger than the batch, as the backend keeps one for its largest batch.
    workspace = DecodeWorkspace.allocate(
        max_batch_size=bs + 3,
        num_heads=num_heads,
        head_dim=head_dim,
        max_kv_splits=max_kv_splits,
        device=DEVICE,
    )
    poison(workspace.partial_out)
    poison(workspace.partial_lse)
    if out is None:
        out = poison(torch.empty_like(q))
    return decode_attention(
        q=q,
        k_buffer=ctx.k_buffer,
        v_buffer=ctx.v_buffer,
        req_to_token=ctx.req_to_token,
        req_rows=ctx.req_rows,
        seq_lens=ctx.seq_lens,
        num_kv_splits=splits,
        workspace=workspace,
        sm_scale=1 / math.sqrt(head_dim),
        out=out,
        block_n=block_n,
        kv_pack=kv_pack,
        **widening,
    )


def reference(ctx: Context, q: torch.Tensor) -> torch.Tensor:
    return decode_attention_ref(
        q=q,
        k_buffer=ctx.k_buffer,
        v_buffer=ctx.v_buffer,
        req_to_token=ctx.req_to_token,
        req_rows=ctx.req_rows,
        seq_lens=ctx.seq_lens,
        sm_scale=1 / math.sqrt(q.shape[-1]),
    )


# (seq_lens, num_heads, num_kv_heads, head_dim, splits): splits "auto" = num_kv_splits_for
# with chunks of >= 64 keys, an int = that many for every request.
CASES = [
    ([1], 4, 4, 64, 1),
    ([300, 1, 37], 8, 2, 13, "auto"),
    ([5, 1, 33, 16, 2, 40, 17, 9], 8, 1, 80, 3),
    ([300, 17, 64], 4, 1, 128, 8),  # 8 chunks of 48 keys for 300; most of 17's are empty
    ([20, 5], 32, 1, 16, 2),  # a group of 32 spans two programs of 16 heads
    ([0, 12], 4, 2, 16, 2),  # seq_len 0: a padded request of a CUDA graph batch gets zeros
]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "splits"),
    CASES,
    ids=[f"lens{len(c[0])}-h{c[1]}-kv{c[2]}-d{c[3]}-s{c[4]}" for c in CASES],
)
def test_matches_reference(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    splits: int | str,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_heads * 7 + head_dim)
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    if splits == "auto":
        max_kv_splits = 4
        num_splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=4, min_split_len=64)
        assert num_splits.tolist() == [4, 1, 1]
    else:
        assert isinstance(splits, int)
        max_kv_splits = splits
        num_splits = torch.full((len(seq_lens),), splits, dtype=torch.int32, device=DEVICE)
    out = run(ctx, q, num_splits, max_kv_splits=max_kv_splits, block_n=16)
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[dtype])


@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "splits", "dtype", "kv_dtype"),
    fp8_attention_params(
        CASES, [f"lens{len(c[0])}-h{c[1]}-kv{c[2]}-d{c[3]}-s{c[4]}" for c in CASES]
    ),
)
def test_fp8_pool_matches_reference(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    splits: int | str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> None:
    """An fp8 pool (--kv-cache-dtype): the kernel widens each K/V element to the query's
    dtype, exactly, so it matches the reference (which widens to fp32) to the query dtype's
    tolerance, not fp8's."""
    gen = torch.Generator().manual_seed(sum(seq_lens) + num_heads * 7 + head_dim + 1)
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen, kv_dtype=kv_dtype)
    assert ctx.k_buffer.dtype == kv_dtype and ctx.v_buffer.dtype == kv_dtype
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    max_kv_splits = 4 if splits == "auto" else int(splits)
    num_splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=max_kv_splits, min_split_len=64)
    out = run(ctx, q, num_splits, max_kv_splits=max_kv_splits, block_n=16)
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[dtype])


# (seq_lens, num_heads, num_kv_heads, head_dim, kv_pack)
PACKS = [
    ([300, 1, 37], 8, 4, 64, 2),  # groups of 2: 4 rows of a 16-row block
    ([5, 90, 17], 16, 4, 32, 4),  # groups of 4, all four KV heads: the block's 16 rows
    ([40, 3], 4, 4, 13, 4),  # one query head a KV head; an odd head dim (masked columns)
]


@pytest.mark.parametrize("pool", [None, torch.float8_e5m2])
@pytest.mark.parametrize(
    ("seq_lens", "num_heads", "num_kv_heads", "head_dim", "kv_pack"),
    PACKS,
    ids=[f"h{c[1]}-kv{c[2]}-d{c[3]}-pack{c[4]}" for c in PACKS],
)
def test_packed_kv_heads_match_reference(
    seq_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    kv_pack: int,
    pool: torch.dtype | None,
) -> None:
    """Several KV heads a program (each key's rows of those heads one load): every query
    head still attends over its own KV head only."""
    dtype = torch.float32 if pool is None else torch.bfloat16
    gen = torch.Generator().manual_seed(sum(seq_lens) + kv_pack)
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen, kv_dtype=pool)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=4, min_split_len=32)
    out = run(ctx, q, splits, max_kv_splits=4, block_n=16, kv_pack=kv_pack)
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[dtype])


@pytest.mark.parametrize(
    ("num_heads", "num_kv_heads", "kv_pack", "message"),
    [
        (8, 4, 3, "kv_pack must be 1, 2 or 4, got 3"),
        (12, 6, 4, "kv_pack 4 does not divide the 6 KV heads"),
        (32, 4, 4, "kv_pack 4 x 8 query heads per KV head exceeds one program's 16 rows"),
    ],
)
def test_kv_pack_that_cannot_run_is_refused(
    num_heads: int, num_kv_heads: int, kv_pack: int, message: str
) -> None:
    gen = torch.Generator().manual_seed(3)
    ctx = make_context([4], num_kv_heads, 16, torch.float32, gen)
    q = randn(1, num_heads, 16, dtype=torch.float32, gen=gen)
    splits = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match=message):
        run(ctx, q, splits, max_kv_splits=1, kv_pack=kv_pack)


def test_early_widening_of_a_16_bit_pool_is_refused() -> None:
    gen = torch.Generator().manual_seed(4)
    ctx = make_context([4], 2, 16, torch.float32, gen)
    q = randn(1, 4, 16, dtype=torch.float32, gen=gen)
    splits = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="early_k and early_v apply to fp8 pools, not"):
        run(ctx, q, splits, max_kv_splits=1, early_k=True)


def test_choose_kv_pack_packs_large_batches_and_short_rows() -> None:
    # Llama-3.1-8B's heads (groups of 4, 8 KV heads): bf16 rows of 256 bytes, fp8 of 128
    assert [choose_kv_pack(bs, 4, 8, 256) for bs in (1, 16, 63, 64, 256)] == [1, 1, 1, 4, 4]
    assert [choose_kv_pack(bs, 4, 8, 128) for bs in (1, 15, 16, 256)] == [2, 2, 4, 4]
    assert choose_kv_pack(256, 8, 8, 256) == 2  # groups of 8: two heads fill 16 rows
    assert choose_kv_pack(256, 16, 8, 256) == 1
    assert choose_kv_pack(256, 4, 6, 256) == 2  # 4 does not divide 6 KV heads
    assert choose_kv_pack(256, 7, 4, 256) == 2  # Qwen2-7B: 28 / 4 heads
    assert choose_kv_pack(256, 2, 8, 512) == 2  # Gemma 2's bf16 heads of 256: 1 KB a key
    assert choose_kv_pack(256, 2, 8, 1024) == 1  # fp32 heads of 256


def test_splits_agree_with_each_other() -> None:
    """One chunk or many, the merged result is the same."""
    gen = torch.Generator().manual_seed(1)
    ctx = make_context([300, 90], 2, 64, torch.float32, gen)
    q = randn(2, 4, 64, dtype=torch.float32, gen=gen)
    outs = []
    for s in (1, 2, 5):
        splits = torch.full((2,), s, dtype=torch.int32, device=DEVICE)
        outs.append(run(ctx, q, splits, max_kv_splits=5))
    torch.testing.assert_close(outs[1], outs[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(outs[2], outs[0], atol=1e-5, rtol=1e-5)


def test_splits_are_clamped_to_the_workspace() -> None:
    gen = torch.Generator().manual_seed(2)
    ctx = make_context([100, 3], 1, 16, torch.float32, gen)
    q = randn(2, 2, 16, dtype=torch.float32, gen=gen)
    splits = torch.tensor([50, 0], dtype=torch.int32, device=DEVICE)  # 50 > 2; 0 -> 1
    out = run(ctx, q, splits, max_kv_splits=2, block_n=16)
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[torch.float32])


def test_strided_inputs_and_int32_table() -> None:
    """q a view into a fused qkv tensor, out a view into a wider one, the table int32."""
    gen = torch.Generator().manual_seed(3)
    ctx = make_context([40, 7, 65], 2, 16, torch.float32, gen, table_dtype=torch.int32)
    qkv = randn(3, 8, 16, dtype=torch.float32, gen=gen)
    q = qkv[:, 2:6]  # [3, 4, 16] with token stride 128
    wide = poison(torch.empty(3, 6, 16, device=DEVICE))
    splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=3, min_split_len=16)
    out = run(ctx, q, splits, max_kv_splits=3, out=wide[:, 1:5])
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[torch.float32])
    assert wide[:, 0].isnan().all() and wide[:, 5].isnan().all()


def test_num_kv_splits_for() -> None:
    lens = torch.tensor([0, 1, 64, 65, 1000])
    assert num_kv_splits_for(lens, max_kv_splits=8, min_split_len=64).tolist() == [1, 1, 1, 2, 8]
    assert num_kv_splits_for(lens, max_kv_splits=8, min_split_len=64).dtype == torch.int32


def _args(**overrides: object) -> dict[str, object]:
    gen = torch.Generator().manual_seed(4)
    ctx = make_context([5, 3], 2, 16, torch.float32, gen)
    q = randn(2, 4, 16, dtype=torch.float32, gen=gen)
    args: dict[str, object] = {
        "q": q,
        "k_buffer": ctx.k_buffer,
        "v_buffer": ctx.v_buffer,
        "req_to_token": ctx.req_to_token,
        "req_rows": ctx.req_rows,
        "seq_lens": ctx.seq_lens,
        "num_kv_splits": torch.ones(2, dtype=torch.int32, device=DEVICE),
        "workspace": DecodeWorkspace.allocate(
            max_batch_size=2, num_heads=4, head_dim=16, max_kv_splits=2, device=DEVICE
        ),
        "sm_scale": 0.25,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"q": torch.zeros(2, 64, device=DEVICE)}, ValueError, r"q must have shape"),
        ({"q": torch.zeros(2, 3, 16, device=DEVICE)}, ValueError, r"multiple of num_kv_heads"),
        ({"q": torch.zeros(2, 4, 16, dtype=torch.int32, device=DEVICE)}, TypeError, r"q must be"),
        ({"k_buffer": torch.zeros(9, 2, 8, device=DEVICE)}, ValueError, r"k_buffer must have"),
        ({"v_buffer": torch.zeros(9, 2, 16, device=DEVICE)}, ValueError, r"v_buffer must have"),
        ({"req_rows": torch.zeros(3, dtype=torch.int64, device=DEVICE)}, ValueError, r"req_rows"),
        ({"req_to_token": torch.zeros(4, 9, device=DEVICE)}, TypeError, r"req_to_token must be"),
        ({"seq_lens": torch.zeros(2, device=DEVICE)}, TypeError, r"seq_lens must be"),
        (
            {"q": torch.zeros(4, 16, 2, device=DEVICE).transpose(1, 2)},
            ValueError,
            r"q must be contiguous in its last dimension",
        ),
        (
            {
                "workspace": DecodeWorkspace.allocate(
                    max_batch_size=1, num_heads=4, head_dim=16, max_kv_splits=2, device=DEVICE
                )
            },
            ValueError,
            r"workspace must be fp32",
        ),
        ({"out": torch.zeros(2, 4, 16, dtype=torch.float16, device=DEVICE)}, TypeError, r"out"),
        ({"block_n": 24}, ValueError, r"block_n must be a power of two"),
        (
            {"k_buffer": torch.zeros(9, 2, 16, dtype=torch.int8, device=DEVICE)},
            TypeError,
            r"k_buffer must be one of float16, bfloat16, float32, float8_e5m2, float8_e4m3fn",
        ),
        (
            {"v_buffer": torch.zeros(15, 2, 16, dtype=torch.float8_e5m2, device=DEVICE)},
            TypeError,
            r"v_buffer must be one of float32, got torch.float8_e5m2",
        ),
    ],
)
def test_rejects_bad_arguments(
    overrides: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        decode_attention(**_args(**overrides))  # type: ignore[arg-type]


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", [None, *FP8_KV_DTYPES])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(32, 8, 128), (12, 4, 96)])
def test_large_on_gpu(
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None,
) -> None:
    gen = torch.Generator().manual_seed(5)
    seq_lens = [4096, 1, 2000, 777, 3, 1500, 64, 8191]
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen, kv_dtype=kv_dtype)
    q = randn(len(seq_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=16, min_split_len=256)
    out = run(ctx, q, splits, max_kv_splits=16)
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[dtype])


@pytest.mark.gpu
@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
@pytest.mark.parametrize("kv_pack", [1, 4])
@pytest.mark.parametrize(
    ("early_k", "early_v", "lazy_rescale"),
    [
        (False, False, False),
        (True, False, False),
        (False, True, False),
        (True, True, False),
        (True, True, True),
        (False, False, True),
    ],
)
def test_fp8_widenings_match_reference_on_gpu(
    kv_dtype: torch.dtype, kv_pack: int, early_k: bool, early_v: bool, lazy_rescale: bool
) -> None:
    """K and V tiles widened by Triton after shared memory, or by kernels/fp8_widen.py's
    inline PTX before it: each way exact, so each matches the reference (with and without
    the lazy rescale)."""
    gen = torch.Generator().manual_seed(6)
    seq_lens = [4096, 1, 2000, 777, 3, 1500, 64, 8191]
    ctx = make_context(seq_lens, 8, 128, torch.bfloat16, gen, kv_dtype=kv_dtype)
    q = randn(len(seq_lens), 32, 128, dtype=torch.bfloat16, gen=gen)
    splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=16, min_split_len=256)
    out = run(
        ctx,
        q,
        splits,
        max_kv_splits=16,
        kv_pack=kv_pack,
        early_k=early_k,
        early_v=early_v,
        lazy_rescale=lazy_rescale,
    )
    torch.testing.assert_close(out, reference(ctx, q), **TOLERANCES[torch.bfloat16])


@pytest.mark.parametrize("pool", [None, torch.float8_e5m2])
@pytest.mark.parametrize("kv_pack", [1, 2])
def test_lazy_rescale_matches_reference(pool: torch.dtype | None, kv_pack: int) -> None:
    """lazy_rescale moves a row's running max only when its scores rise more than
    RESCALE_AT past it. Keys whose scores climb along the context (by 120 nats
    over it: past fp32's range unless the max moves)
    take both branches, several times, in every chunk."""
    dtype = torch.float32 if pool is None else torch.bfloat16
    gen = torch.Generator().manual_seed(11)
    seq_lens = [160, 7, 97]
    num_kv_heads, head_dim = 4, 32
    ctx = make_context(seq_lens, num_kv_heads, head_dim, torch.float32, gen)
    q = randn(len(seq_lens), 8, head_dim, dtype=torch.float32, gen=gen)
    for b, row in enumerate(ctx.req_rows.tolist()):
        slots = ctx.req_to_token[row, : seq_lens[b]].long()
        ramp = torch.linspace(0.0, 120.0, seq_lens[b], device=DEVICE)
        # Each KV head's keys along its query heads' mean direction, growing with position.
        direction = q[b].view(num_kv_heads, 2, head_dim).mean(1)
        unit = direction / direction.norm(dim=-1, keepdim=True) ** 2 * math.sqrt(head_dim)
        ctx.k_buffer[slots] = ctx.k_buffer[slots] * 0.1 + ramp[:, None, None] * unit
    ctx = dataclasses.replace(
        ctx,
        k_buffer=quantize_kv(ctx.k_buffer, pool or dtype),
        v_buffer=quantize_kv(ctx.v_buffer, pool or dtype),
    )
    q = q.to(dtype)
    splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=2, min_split_len=64)
    out = run(ctx, q, splits, max_kv_splits=2, block_n=16, kv_pack=kv_pack, lazy_rescale=True)
    # Scores of up to 120 carry fp32 rounding of about 1e-5 into the weights.
    tol = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else TOLERANCES[dtype]
    torch.testing.assert_close(out, reference(ctx, q), **tol)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernel runs natively")
def test_early_widening_is_refused_by_the_interpreter() -> None:
    gen = torch.Generator().manual_seed(4)
    ctx = make_context([4], 2, 16, torch.bfloat16, gen, kv_dtype=torch.float8_e5m2)
    q = randn(1, 4, 16, dtype=torch.bfloat16, gen=gen)
    splits = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="need an NVIDIA GPU"):
        run(ctx, q, splits, max_kv_splits=1, early_v=True)
