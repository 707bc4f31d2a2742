"""The torch reference backend against a per-token softmax written out by hand."""

from __future__ import annotations

import math

import pytest
import torch

from services.executor.attention import get_backend
from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import KVPool, ReqToTokenPool


def naive_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, prefix: int
) -> torch.Tensor:
    """q [n, heads, d]; keys/values [prefix + n, kv_heads, d] -> [n, heads, d]."""
    group = q.shape[1] // keys.shape[1]
    out = torch.empty_like(q)
    for i in range(q.shape[0]):
        visible = prefix + i + 1
        for h in range(q.shape[1]):
            k = keys[:visible, h // group]
            scores = (k @ q[i, h]) / math.sqrt(q.shape[-1])
            out[i, h] = torch.softmax(scores, dim=0) @ values[:visible, h // group]
    return out


def make_batch(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_kv_heads: int,
    head_dim: int,
    gen: torch.Generator,
) -> tuple[ForwardBatch, list[torch.Tensor]]:
    """A batch whose requests own shuffled slots of a pool poisoned with large junk; cached
    prefixes hold random K/V. Returns the batch and each request's slot list."""
    total = sum(prefix_lens) + sum(extend_lens)
    pool = KVPool(total + 16, 1, num_kv_heads, head_dim, torch.float32, "cpu")
    pool.k_buffers[0].normal_(0, 100, generator=gen)
    pool.v_buffers[0].normal_(0, 100, generator=gen)
    table = ReqToTokenPool(len(prefix_lens) + 2, max(prefix_lens) + max(extend_lens) + 3, "cpu")
    perm = torch.randperm(total + 16, generator=gen).tolist()
    slots, new_locs, rows = [], [], []
    for p, e in zip(prefix_lens, extend_lens, strict=True):
        own, perm = perm[: p + e], perm[p + e :]
        row = table.allocate()
        table.write(row, 0, own)
        pool.k_buffers[0][own[:p]] = torch.randn(p, num_kv_heads, head_dim, generator=gen)
        pool.v_buffers[0][own[:p]] = torch.randn(p, num_kv_heads, head_dim, generator=gen)
        slots.append(torch.tensor(own))
        new_locs += own[p:]
        rows.append(row)
    table.flush()
    n = sum(extend_lens)
    batch = ForwardBatch(
        mode=mode,
        input_ids=torch.zeros(n, dtype=torch.int64),
        positions=torch.zeros(n, dtype=torch.int64),  # unused by attention
        out_cache_loc=torch.tensor(new_locs),
        req_rows=torch.tensor(rows),
        seq_lens=torch.tensor([p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]),
        prefix_lens_cpu=prefix_lens,
        extend_lens_cpu=extend_lens,
        kv_pool=pool,
        req_to_token=table,
    )
    return batch, slots


@pytest.mark.parametrize(
    ("mode", "prefix_lens", "extend_lens"),
    [
        (ForwardMode.EXTEND, [0, 0], [5, 1]),
        (ForwardMode.EXTEND, [3, 0, 7], [4, 6, 1]),
        (ForwardMode.DECODE, [0, 4, 9, 1], [1, 1, 1, 1]),
        (ForwardMode.DECODE, [12], [1]),
    ],
)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(4, 4), (4, 2), (6, 1)])
@pytest.mark.parametrize("head_dim", [16, 13, 64])
def test_torch_backend_matches_naive(
    mode: ForwardMode,
    prefix_lens: list[int],
    extend_lens: list[int],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
) -> None:
    gen = torch.Generator().manual_seed(head_dim * 100 + num_heads * 10 + num_kv_heads)
    batch, slots = make_batch(mode, prefix_lens, extend_lens, num_kv_heads, head_dim, gen)
    n = sum(extend_lens)
    q = torch.randn(n, num_heads, head_dim, generator=gen)
    k = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(n, num_kv_heads, head_dim, generator=gen)
    backend = get_backend("torch")
    backend.init_forward_metadata(batch)
    out = backend.forward(q, k, v, 0, batch)

    pool = batch.kv_pool
    torch.testing.assert_close(pool.k_buffers[0][batch.out_cache_loc], k)
    torch.testing.assert_close(pool.v_buffers[0][batch.out_cache_loc], v)
    start = 0
    for p, e, own in zip(prefix_lens, extend_lens, slots, strict=True):
        expected = naive_attention(
            q[start : start + e], pool.k_buffers[0][own], pool.v_buffers[0][own], p
        )
        torch.testing.assert_close(out[start : start + e], expected, atol=1e-5, rtol=1e-5)
        start += e


def test_unknown_backend_is_named() -> None:
    with pytest.raises(ValueError, match="'flash9'"):
        get_backend("flash9")
