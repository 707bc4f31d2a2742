"""Sliding windows and softcaps (Gemma) in the decode and extend kernels, against their torch
twins: windows smaller than, equal to and larger than the context, chunked extends whose
cached prefix falls partly out of the window, a window of one key, a non-default scale."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kernels.decode_attention import (
    DecodeWorkspace,
    decode_attention,
    decode_attention_ref,
    num_kv_splits_for,
)
from kernels.extend_attention import extend_attention, extend_attention_ref
from tests.kernels.helpers import DEVICE, DOT_DTYPES, TOLERANCES, make_context, poison, randn
from tests.kernels.test_extend_attention import batch_tensors

SCALE = 0.3  # not 1/sqrt(head_dim): the scale is the caller's (query_pre_attn_scalar)

# (prefix_lens, extend_lens, window, softcap, block_m, block_n)
EXTEND_CASES = [
    ([0, 0], [20, 3], 5, None, 16, 16),  # prefill longer than the window; one shorter
    ([0, 30, 7], [9, 12, 1], 1, 2.5, 16, 16),  # a window of one: each token sees itself
    ([25, 0, 3], [40, 16, 5], 16, None, 16, 16),  # window == tile; prefix partly out of it
    ([25, 0, 3], [40, 16, 5], 16, 2.5, 16, 16),  # the same, soft-capped
    ([40, 0], [6, 46], 46, 2.5, 32, 16),  # window == context of both; block_m > block_n
    ([12, 300], [4, 20], 40, None, 16, 16),  # long prefix mostly out of the window
    ([5, 9], [3, 7], 500, None, 16, 16),  # window larger than any context: plain causal
    ([0, 17, 2], [33, 2, 30], 9, 2.5, 32, 16),  # window smaller than a tile
]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("prefix_lens", "extend_lens", "window", "softcap", "block_m", "block_n"),
    EXTEND_CASES,
    ids=[f"bs{len(c[0])}-w{c[2]}-cap{c[3]}-m{c[4]}n{c[5]}" for c in EXTEND_CASES],
)
def test_extend_window_softcap(
    prefix_lens: list[int],
    extend_lens: list[int],
    window: int,
    softcap: float | None,
    block_m: int,
    block_n: int,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(sum(prefix_lens) + window)
    seq_lens = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    ctx = make_context(seq_lens, 2, 16, dtype, gen)
    q = randn(sum(extend_lens), 4, 16, dtype=dtype, gen=gen)
    tables = batch_tensors(prefix_lens, extend_lens)
    common: dict[str, Any] = {
        "q": q,
        "k_buffer": ctx.k_buffer,
        "v_buffer": ctx.v_buffer,
        "req_to_token": ctx.req_to_token,
        "req_rows": ctx.req_rows,
        **tables,
        "sm_scale": SCALE,
        "window": window,
        "softcap": softcap,
    }
    out = extend_attention(
        **common,
        max_extend_len=max(extend_lens),
        out=poison(torch.empty_like(q)),
        block_m=block_m,
        block_n=block_n,
    )
    want = extend_attention_ref(**common)
    torch.testing.assert_close(out, want, **TOLERANCES[dtype])
    if window >= max(seq_lens) and softcap is None:  # the window hides nothing
        plain = extend_attention_ref(**{**common, "window": None})
        torch.testing.assert_close(want, plain, atol=0.0, rtol=0.0)


def test_extend_window_really_masks() -> None:
    """The reference hides the keys out of the window (so the comparisons above mean it)."""
    gen = torch.Generator().manual_seed(7)
    ctx = make_context([12], 1, 16, torch.float32, gen)
    q = randn(12, 1, 16, dtype=torch.float32, gen=gen)
    common: dict[str, Any] = {
        "q": q,
        "k_buffer": ctx.k_buffer,
        "v_buffer": ctx.v_buffer,
        "req_to_token": ctx.req_to_token,
        "req_rows": ctx.req_rows,
        **batch_tensors([0], [12]),
        "sm_scale": SCALE,
    }
    windowed = extend_attention_ref(**common, window=3)
    plain = extend_attention_ref(**common)
    torch.testing.assert_close(windowed[:3], plain[:3])  # the first 3 see all they have
    assert not torch.allclose(windowed[3:], plain[3:])
    # Token 11 with a window of 3 sees keys 9..11 only: its own softmax over them.
    slots = ctx.req_to_token[ctx.req_rows[0], 9:12]
    scores = (ctx.k_buffer[slots, 0] @ q[11, 0]) * SCALE
    expected = scores.softmax(-1) @ ctx.v_buffer[slots, 0]
    torch.testing.assert_close(windowed[11, 0], expected, atol=1e-5, rtol=1e-5)


# (seq_lens, window, softcap, splits): splits "auto" = num_kv_splits_for, chunks >= 16 keys
DECODE_CASES = [
    ([1, 7, 40, 300], 7, None, "auto"),  # window < context, == context, > context
    ([1, 7, 40, 300], 7, 2.5, "auto"),  # the same, soft-capped
    ([300, 65, 2], 1, None, 3),  # a window of one key
    ([300, 90, 17], 64, 2.5, 4),  # window split into chunks; trailing chunks empty
    ([5, 33], 500, None, 2),  # window larger than every context
    ([0, 12], 4, 2.5, 2),  # seq_len 0: a padded request gets zeros
]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("seq_lens", "window", "softcap", "splits"),
    DECODE_CASES,
    ids=[f"bs{len(c[0])}-w{c[1]}-cap{c[2]}-s{c[3]}" for c in DECODE_CASES],
)
def test_decode_window_softcap(
    seq_lens: list[int],
    window: int,
    softcap: float | None,
    splits: int | str,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(sum(seq_lens) + window)
    ctx = make_context(seq_lens, 2, 16, dtype, gen)
    bs = len(seq_lens)
    q = randn(bs, 8, 16, dtype=dtype, gen=gen)
    max_splits = 4 if splits == "auto" else int(splits)
    if splits == "auto":
        num_splits = num_kv_splits_for(ctx.seq_lens, max_kv_splits=4, min_split_len=16)
    else:
        num_splits = torch.full((bs,), max_splits, dtype=torch.int32, device=DEVICE)
    workspace = DecodeWorkspace.allocate(
        max_batch_size=bs + 1, num_heads=8, head_dim=16, max_kv_splits=max_splits, device=DEVICE
    )
    poison(workspace.partial_out)
    poison(workspace.partial_lse)
    common: dict[str, Any] = {
        "q": q,
        "k_buffer": ctx.k_buffer,
        "v_buffer": ctx.v_buffer,
        "req_to_token": ctx.req_to_token,
        "req_rows": ctx.req_rows,
        "seq_lens": ctx.seq_lens,
        "sm_scale": SCALE,
        "window": window,
        "softcap": softcap,
    }
    out = decode_attention(
        **common,
        num_kv_splits=num_splits,
        workspace=workspace,
        out=poison(torch.empty_like(q)),
        block_n=16,
    )
    torch.testing.assert_close(out, decode_attention_ref(**common), **TOLERANCES[dtype])


@pytest.mark.parametrize(
    ("window", "softcap", "match"),
    [(0, None, "window must be a positive int"), (None, 0.0, "softcap must be positive")],
)
def test_rejects_bad_window_or_softcap(
    window: int | None, softcap: float | None, match: str
) -> None:
    gen = torch.Generator().manual_seed(1)
    ctx = make_context([3], 1, 16, torch.float32, gen)
    q = randn(3, 2, 16, dtype=torch.float32, gen=gen)
    with pytest.raises(ValueError, match=match):
        extend_attention(
            q=q,
            k_buffer=ctx.k_buffer,
            v_buffer=ctx.v_buffer,
            req_to_token=ctx.req_to_token,
            req_rows=ctx.req_rows,
            **batch_tensors([0], [3]),
            max_extend_len=3,
            sm_scale=SCALE,
            window=window,
            softcap=softcap,
        )
