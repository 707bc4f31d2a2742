"""extend_attention against its torch twin: cached prefixes of 0..300 tokens, extends of 0..40,
GQA groups, odd head dims."""

from __future__ import annotations

import math
from typing import TypedDict

import pytest
import torch

from kernels.extend_attention import extend_attention, extend_attention_ref
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
    spread_params,
)


class BatchTables(TypedDict):
    prefix_lens: torch.Tensor
    extend_lens: torch.Tensor
    extend_starts: torch.Tensor


def batch_tensors(prefix_lens: list[int], extend_lens: list[int]) -> BatchTables:
    starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]

    def t(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=DEVICE)

    return {
        "prefix_lens": t(prefix_lens),
        "extend_lens": t(extend_lens),
        "extend_starts": t(starts),
    }


def run(
    ctx: Context,
    q: torch.Tensor,
    prefix_lens: list[int],
    extend_lens: list[int],
    *,
    out: torch.Tensor | None = None,
    block: int | None = None,
    block_n: int | None = None,
    heavy_first: bool = True,
) -> torch.Tensor:
    if out is None:
        out = poison(torch.empty_like(q))
    tables = batch_tensors(prefix_lens, extend_lens)
    return extend_attention(
        q=q,
        k_buffer=ctx.k_buffer,
        v_buffer=ctx.v_buffer,
        req_to_token=ctx.req_to_token,
        req_rows=ctx.req_rows,
        prefix_lens=tables["prefix_lens"],
        extend_lens=tables["extend_lens"],
        extend_starts=tables["extend_starts"],
        max_extend_len=max(extend_lens),
        sm_scale=1 / math.sqrt(q.shape[-1]),
        out=out,
        block_m=block,
        block_n=block_n or block,
        heavy_first=heavy_first,
    )


def reference(
    ctx: Context, q: torch.Tensor, prefix_lens: list[int], extend_lens: list[int]
) -> torch.Tensor:
    return extend_attention_ref(
        q=q,
        k_buffer=ctx.k_buffer,
        v_buffer=ctx.v_buffer,
        req_to_token=ctx.req_to_token,
        req_rows=ctx.req_rows,
        **batch_tensors(prefix_lens, extend_lens),
        sm_scale=1 / math.sqrt(q.shape[-1]),
    )


# (prefix_lens, extend_lens, num_heads, num_kv_heads, head_dim)
CASES = [
    ([0], [1], 4, 4, 64),
    ([0, 5, 300], [7, 1, 3], 8, 2, 13),
    ([0, 3, 0, 17, 1, 0, 40, 2], [1, 20, 33, 2, 1, 5, 9, 16], 8, 1, 80),
    ([0, 0, 60], [40, 17, 1], 4, 1, 128),
    ([3, 100, 0], [4, 0, 1], 2, 2, 16),  # a request with no new tokens is skipped
]


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "num_heads", "num_kv_heads", "head_dim", "dtype"),
    spread_params(
        CASES, DOT_DTYPES, ids=[f"bs{len(c[0])}-h{c[2]}-kv{c[3]}-d{c[4]}" for c in CASES]
    ),
)
def test_matches_reference(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(sum(prefix_lens) + sum(extend_lens) + head_dim)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen)
    q = randn(sum(extend_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    out = run(ctx, q, prefix_lens, extend_lens, block=16)
    torch.testing.assert_close(
        out, reference(ctx, q, prefix_lens, extend_lens), **TOLERANCES[dtype]
    )


@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "num_heads", "num_kv_heads", "head_dim", "dtype", "kv_dtype"),
    fp8_attention_params(CASES, [f"bs{len(c[0])}-h{c[2]}-kv{c[3]}-d{c[4]}" for c in CASES]),
)
def test_fp8_pool_matches_reference(
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
) -> None:
    """An fp8 pool (--kv-cache-dtype), prefix and new tokens alike read from it and widened
    exactly: the query dtype's tolerance, as for a pool in the model's dtype."""
    gen = torch.Generator().manual_seed(sum(prefix_lens) + sum(extend_lens) + head_dim + 1)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen, kv_dtype=kv_dtype)
    assert ctx.k_buffer.dtype == kv_dtype and ctx.v_buffer.dtype == kv_dtype
    q = randn(sum(extend_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    out = run(ctx, q, prefix_lens, extend_lens, block=16)
    torch.testing.assert_close(
        out, reference(ctx, q, prefix_lens, extend_lens), **TOLERANCES[dtype]
    )


def test_default_blocks_and_strided_views() -> None:
    """q a view into a fused qkv tensor, out a view into a wider one, default tile sizes."""
    gen = torch.Generator().manual_seed(1)
    prefix_lens, extend_lens = [50, 0], [45, 70]
    ctx = make_context([95, 70], 2, 32, torch.float32, gen, table_dtype=torch.int32)
    qkv = randn(115, 8, 32, dtype=torch.float32, gen=gen)
    q = qkv[:, :4]
    wide = poison(torch.empty(115, 5, 32, device=DEVICE))
    out = run(ctx, q, prefix_lens, extend_lens, out=wide[:, 1:])
    expected = reference(ctx, q, prefix_lens, extend_lens)
    torch.testing.assert_close(out, expected, **TOLERANCES[torch.float32])
    assert wide[:, 0].isnan().all()


@pytest.mark.parametrize("heavy_first", [True, False])
@pytest.mark.parametrize(("block_m", "block_n"), [(16, 32), (32, 16), (64, 16)])
def test_unequal_tiles_and_grid_order(block_m: int, block_n: int, heavy_first: bool) -> None:
    """Query and key tiles of different sizes move the line between the tiles every query
    sees and the diagonal ones (masked) off the tile grid; either grid order gives the same.
    Extends up to 100 tokens span several query blocks, beside and after cached prefixes."""
    gen = torch.Generator().manual_seed(block_m + 3 * block_n)
    prefix_lens, extend_lens = [0, 37, 5, 0], [100, 70, 1, 33]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    ctx = make_context(seq_lens, 2, 32, torch.float32, gen)
    q = randn(sum(extend_lens), 4, 32, dtype=torch.float32, gen=gen)
    out = run(ctx, q, prefix_lens, extend_lens, block=block_m, block_n=block_n,
              heavy_first=heavy_first)  # fmt: skip
    torch.testing.assert_close(
        out, reference(ctx, q, prefix_lens, extend_lens), **TOLERANCES[torch.float32]
    )


def test_prefix_is_the_causal_past() -> None:
    """Extending a request chunk by chunk gives what one extend over all of it gives."""
    gen = torch.Generator().manual_seed(2)
    ctx = make_context([30], 1, 16, torch.float32, gen)
    q = randn(30, 2, 16, dtype=torch.float32, gen=gen)
    whole = run(ctx, q, [0], [30])
    first = run(ctx, q[:12], [0], [12])
    second = run(ctx, q[12:], [12], [18])
    torch.testing.assert_close(torch.cat([first, second]), whole, atol=1e-5, rtol=1e-5)


def _args(**overrides: object) -> dict[str, object]:
    gen = torch.Generator().manual_seed(3)
    ctx = make_context([5, 3], 2, 16, torch.float32, gen)
    args: dict[str, object] = {
        "q": randn(4, 4, 16, dtype=torch.float32, gen=gen),
        "k_buffer": ctx.k_buffer,
        "v_buffer": ctx.v_buffer,
        "req_to_token": ctx.req_to_token,
        "req_rows": ctx.req_rows,
        **batch_tensors([3, 1], [2, 2]),
        "max_extend_len": 2,
        "sm_scale": 0.25,
    }
    args.update(overrides)
    return args


@pytest.mark.parametrize(
    ("overrides", "error", "match"),
    [
        ({"q": torch.zeros(4, 64, device=DEVICE)}, ValueError, r"q must have shape"),
        ({"q": torch.zeros(4, 5, 16, device=DEVICE)}, ValueError, r"multiple of num_kv_heads"),
        ({"k_buffer": torch.zeros(9, 2, 8, device=DEVICE)}, ValueError, r"k_buffer must have"),
        ({"v_buffer": torch.zeros(9, 2, 16, device=DEVICE)}, ValueError, r"v_buffer must have"),
        ({"prefix_lens": torch.zeros(3, dtype=torch.int64, device=DEVICE)}, ValueError, "prefix"),
        ({"extend_starts": torch.zeros(2, device=DEVICE)}, TypeError, r"extend_starts must be"),
        ({"out": torch.zeros(4, 4, 16, dtype=torch.float16, device=DEVICE)}, TypeError, r"out"),
        ({"max_extend_len": -1}, ValueError, r"max_extend_len"),
        ({"block_m": 8}, ValueError, r"block_m must be a power of two"),
        ({"num_warps": 3}, ValueError, r"num_warps a power of two"),
        ({"num_stages": 9}, ValueError, r"num_stages must be 1 to 8"),
        (
            {"k_buffer": torch.zeros(9, 2, 16, dtype=torch.float64, device=DEVICE)},
            TypeError,
            r"k_buffer must be one of float16, bfloat16, float32, float8_e5m2, float8_e4m3fn",
        ),
    ],
)
def test_rejects_bad_arguments(
    overrides: dict[str, object], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        extend_attention(**_args(**overrides))  # type: ignore[arg-type]


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
    gen = torch.Generator().manual_seed(4)
    prefix_lens, extend_lens = [0, 2000, 513, 0, 64], [1024, 300, 1, 777, 64]
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    ctx = make_context(seq_lens, num_kv_heads, head_dim, dtype, gen, kv_dtype=kv_dtype)
    q = randn(sum(extend_lens), num_heads, head_dim, dtype=dtype, gen=gen)
    out = run(ctx, q, prefix_lens, extend_lens)
    torch.testing.assert_close(
        out, reference(ctx, q, prefix_lens, extend_lens), **TOLERANCES[dtype]
    )
