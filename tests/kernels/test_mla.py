"""The MLA decode and extend kernels against their torch twins: latent ranks (odd ones too),
rotated widths, head counts on either side of a 16-head block, split-K chunking, cached
prefixes, poisoned outputs and workspaces."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.decode_attention import DecodeWorkspace, num_kv_splits_for
from kernels.mla_decode import mla_decode, mla_decode_ref
from kernels.mla_extend import mla_extend, mla_extend_ref
from tests.kernels.helpers import (
    DEVICE,
    DOT_DTYPES,
    FP8_KV_DTYPES,
    TOLERANCES,
    make_context,
    poison,
    randn,
)


def latent_context(
    seq_lens: list[int],
    rank: int,
    rope: int,
    dtype: torch.dtype,
    gen: torch.Generator,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(buffer [slots, 1, rank + rope], req_to_token, req_rows, seq_lens): make_context's
    shuffled slots among junk, with its K buffer as the latent pool (in kv_dtype: fp8)."""
    ctx = make_context(seq_lens, 1, rank + rope, dtype, gen, kv_dtype=kv_dtype)
    return ctx.k_buffer, ctx.req_to_token, ctx.req_rows, ctx.seq_lens


# (seq_lens, num_heads, rank, rope, splits): an int = that many chunks for every request,
# "auto" = num_kv_splits_for with chunks of >= 32 keys.
DECODE_CASES = [
    ([1], 4, 32, 8, 1),
    ([70, 1, 33], 16, 64, 16, "auto"),
    ([5, 40, 17], 20, 48, 8, 3),  # 20 heads: a second, partly masked head block; rank 48
    ([0, 12], 4, 32, 16, 2),  # seq_len 0: a padded request of a CUDA graph batch gets zeros
]
GPU_DECODE_CASES = [
    ([1, 300, 4097], 16, 512, 64, "auto"),  # DeepSeek-V2-Lite's shapes
    ([2000] * 8, 128, 512, 64, 8),  # V3's 128 heads
]


def run_decode(
    seq_lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    splits: int | str,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + heads * 7 + rank)
    buf, table, rows, lens = latent_context(seq_lens, rank, rope, dtype, gen, kv_dtype)
    q = randn(len(seq_lens), heads, rank + rope, dtype=dtype, gen=gen)
    if splits == "auto":
        max_splits = 4
        num_splits = num_kv_splits_for(lens, max_kv_splits=4, min_split_len=32)
    else:
        assert isinstance(splits, int)
        max_splits = splits
        num_splits = torch.full((len(seq_lens),), splits, dtype=torch.int32, device=DEVICE)
    ws = DecodeWorkspace.allocate(
        max_batch_size=len(seq_lens) + 2, num_heads=heads, head_dim=rank,
        max_kv_splits=max_splits, device=DEVICE,
    )  # fmt: skip
    poison(ws.partial_out)
    poison(ws.partial_lse)
    out = poison(q.new_empty(len(seq_lens), heads, rank))
    scale = (rank + rope) ** -0.5
    args: dict[str, Any] = {
        "q": q, "buffer": buf, "rank": rank, "req_to_token": table, "req_rows": rows
    }  # fmt: skip
    mla_decode(
        **args, seq_lens=lens, num_kv_splits=num_splits, workspace=ws, sm_scale=scale, out=out,
        block_n=16,
    )  # fmt: skip
    want = mla_decode_ref(**args, seq_lens=lens, sm_scale=scale)
    torch.testing.assert_close(out, want, **TOLERANCES[dtype])


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("seq_lens", "heads", "rank", "rope", "splits"), DECODE_CASES)
def test_decode_matches_reference(
    seq_lens: list[int], heads: int, rank: int, rope: int, splits: int | str, dtype: torch.dtype
) -> None:
    run_decode(seq_lens, heads, rank, rope, splits, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("seq_lens", "heads", "rank", "rope", "splits"), GPU_DECODE_CASES)
def test_decode_matches_reference_at_deepseek_shapes(
    seq_lens: list[int], heads: int, rank: int, rope: int, splits: int | str, dtype: torch.dtype
) -> None:
    run_decode(seq_lens, heads, rank, rope, splits, dtype)


# (prefix_lens, extend_lens, num_heads, rank, rope)
EXTEND_CASES = [
    ([0], [5], 2, 32, 8),
    ([0, 7, 3], [20, 1, 33], 3, 32, 16),  # cached prefixes beside a fresh prompt
    ([17, 0], [4, 40], 2, 48, 8),
]
GPU_EXTEND_CASES = [([0, 1000, 31], [700, 300, 1], 16, 512, 64)]


def run_extend(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> None:
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    gen = torch.Generator().manual_seed(sum(seq_lens) + heads + rank)
    buf, table, rows, _ = latent_context(seq_lens, rank, rope, dtype, gen, kv_dtype)
    total = sum(extend_lens)
    q = randn(total + 3, heads, rank + rope, dtype=dtype, gen=gen)  # 3 rows of no request
    starts = [0]
    for n in extend_lens[:-1]:
        starts.append(starts[-1] + n)

    def ints(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=DEVICE)

    scale = (rank + rope) ** -0.5
    args: dict[str, Any] = {
        "q": q,
        "buffer": buf,
        "rank": rank,
        "req_to_token": table,
        "req_rows": rows,
        "prefix_lens": ints(prefix_lens),
        "extend_lens": ints(extend_lens),
        "extend_starts": ints(starts),
        "sm_scale": scale,
    }
    out = poison(q.new_empty(total + 3, heads, rank))
    mla_extend(**args, max_extend_len=max(extend_lens), out=out)
    want = mla_extend_ref(**args)
    torch.testing.assert_close(out[:total], want[:total], **TOLERANCES[dtype])
    assert out[total:].isnan().all()  # rows of no request are left alone


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("prefix_lens", "extend_lens", "heads", "rank", "rope"), EXTEND_CASES)
def test_extend_matches_reference(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    dtype: torch.dtype,
) -> None:
    run_extend(prefix_lens, extend_lens, heads, rank, rope, dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("prefix_lens", "extend_lens", "heads", "rank", "rope"), GPU_EXTEND_CASES)
def test_extend_matches_reference_at_deepseek_shapes(
    prefix_lens: list[int],
    extend_lens: list[int],
    heads: int,
    rank: int,
    rope: int,
    dtype: torch.dtype,
) -> None:
    run_extend(prefix_lens, extend_lens, heads, rank, rope, dtype)


@pytest.mark.parametrize("kv_dtype", FP8_KV_DTYPES)
def test_fp8_latent_pool_matches_reference(kv_dtype: torch.dtype) -> None:
    """--kv-cache-dtype fp8: the kernels widen each latent element to the query's dtype
    exactly, as the reference does (so fp32's tolerance holds)."""
    run_decode([70, 1, 33], 4, 32, 8, 3, torch.float32, kv_dtype)
    run_extend([0, 7], [20, 3], 2, 32, 8, torch.float32, kv_dtype)


def test_decode_refuses_a_workspace_of_the_wrong_width() -> None:
    gen = torch.Generator().manual_seed(0)
    buf, table, rows, lens = latent_context([3], 32, 8, torch.float32, gen)
    q = randn(1, 4, 40, dtype=torch.float32, gen=gen)
    ws = DecodeWorkspace.allocate(
        max_batch_size=1, num_heads=4, head_dim=40, max_kv_splits=1, device=DEVICE
    )
    splits = torch.ones(1, dtype=torch.int32, device=DEVICE)
    with pytest.raises(ValueError, match="workspace"):
        mla_decode(
            q=q, buffer=buf, rank=32, req_to_token=table, req_rows=rows, seq_lens=lens,
            num_kv_splits=splits, workspace=ws, sm_scale=1.0,
        )  # fmt: skip
