"""DeepSeek MLA's decode glue kernels against their torch twins: kernels/mla_prep (the query's
rotated part and the new cache rows) and kernels/head_gemv (the absorbed per-head products),
then a tiny DeepSeek model run through them against the torch path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.head_gemv import OUTPUT_TILES, QUERY_TILES, head_gemv, head_gemv_ref
from kernels.mla_prep import mla_prep, mla_prep_ref
from kernels.rotary import build_cos_sin_cache
from services.executor.models import deepseek, layers
from services.executor.weights import load_model
from tests.executor.helpers import write_tiny_model
from tests.kernels.helpers import ALL_DTYPES, DEVICE, TOLERANCES, kernel_device, randn
from tests.kernels.test_triton_backend import greedy_with_prefix_reuse


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("interleave", [True, False], ids=["interleaved", "halves"])
@pytest.mark.parametrize("mscale", [1.0, 0.75], ids=["no-mscale", "mscale"])
def test_prep_matches_reference(dtype: torch.dtype, interleave: bool, mscale: float) -> None:
    n, heads, nope, rope, rank = 3, 19, 16, 8, 40  # heads past one block; rank not a power of 2
    gen = torch.Generator().manual_seed(heads + int(interleave))
    q = randn(n, heads, nope + rope, dtype=dtype, gen=gen)
    kv = randn(n, 2 * (rank + rope), dtype=dtype, gen=gen)[:, : rank + rope]  # a strided view
    cache = build_cos_sin_cache(
        head_dim=rope, theta=10000.0, scaling=None, max_positions=64, device=DEVICE
    )
    norm = randn(rank, dtype=dtype, gen=gen)
    positions = torch.tensor([0, 17, 63], device=DEVICE)
    locs = torch.tensor([5, 1, 8], device=DEVICE)
    common: dict[str, Any] = dict(
        q=q,
        kv=kv,
        out_cache_loc=locs,
        positions=positions,
        cos_sin_cache=cache,
        norm_weight=norm,
        eps=1e-6,
        rank=rank,
        interleave=interleave,
        mscale=mscale,
    )
    outs = []
    for fn in (mla_prep, mla_prep_ref):
        query = torch.full((n, heads, rank + rope), 7.0, dtype=dtype, device=DEVICE)
        buffer = torch.full((10, 1, rank + rope), 7.0, dtype=dtype, device=DEVICE)
        fn(query=query, buffer=buffer, **common)
        outs.append((query, buffer))
    (query, buffer), (want_query, want_buffer) = outs
    assert torch.equal(query[..., :rank], want_query[..., :rank])  # the latent part: untouched
    torch.testing.assert_close(query, want_query, **TOLERANCES[dtype])
    torch.testing.assert_close(buffer, want_buffer, **TOLERANCES[dtype])
    untouched = [s for s in range(10) if s not in (5, 1, 8)]
    assert bool((buffer[untouched] == 7.0).all())


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize(
    ("uk_tiles", "uv_tiles"),
    [((16, 32, 4), (64, 64, 4)), (QUERY_TILES, OUTPUT_TILES)],
    ids=["small", "the-layers-tiles"],
)
def test_head_gemv_takes_both_absorbed_layouts(
    dtype: torch.dtype, uk_tiles: tuple[int, int, int], uv_tiles: tuple[int, int, int]
) -> None:
    """W_UK [heads, nope, rank] as stored, and W_UV^T, a transposed view of the same weight;
    outputs written into strided views, as the layer writes them; with small tiles (several
    steps and column blocks) and with the tiles the layer launches."""
    tokens, heads, nope, v, rank = 3, 4, 24, 20, 72
    gen = torch.Generator().manual_seed(1)
    kv_b = randn(heads, nope + v, rank, dtype=dtype, gen=gen, scale=rank**-0.5)
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:].transpose(1, 2)
    q_nope = randn(tokens, heads, nope + 8, dtype=dtype, gen=gen)[..., :nope]
    query = torch.zeros(tokens, heads, rank + 8, dtype=dtype, device=DEVICE)
    bi, bj, warps = uk_tiles
    head_gemv(q_nope, w_uk, query[..., :rank], block_i=bi, block_j=bj, num_warps=warps)
    torch.testing.assert_close(query[..., :rank], head_gemv_ref(q_nope, w_uk), **TOLERANCES[dtype])
    assert bool((query[..., rank:] == 0).all())
    attn = randn(tokens, heads, rank, dtype=dtype, gen=gen)
    out = torch.empty(tokens, heads, v, dtype=dtype, device=DEVICE)
    bi, bj, warps = uv_tiles
    head_gemv(attn, w_uv, out, block_i=bi, block_j=bj, num_warps=warps)
    torch.testing.assert_close(out, head_gemv_ref(attn, w_uv), **TOLERANCES[dtype])


def test_rejects_a_query_of_the_wrong_width() -> None:
    gen = torch.Generator().manual_seed(2)
    q = randn(1, 2, 24, dtype=torch.float32, gen=gen)
    cache = build_cos_sin_cache(head_dim=8, theta=1e4, scaling=None, max_positions=4, device=DEVICE)
    with pytest.raises(ValueError, match=r"query must have shape \[n, heads, rank \+ rope\]"):
        mla_prep(
            q=q,
            kv=torch.zeros(1, 40, device=DEVICE),
            query=torch.zeros(1, 2, 39, device=DEVICE),
            buffer=torch.zeros(4, 1, 40, device=DEVICE),
            out_cache_loc=torch.zeros(1, dtype=torch.int64, device=DEVICE),
            positions=torch.zeros(1, dtype=torch.int64, device=DEVICE),
            cos_sin_cache=cache,
            norm_weight=torch.ones(32, device=DEVICE),
            eps=1e-6,
            rank=32,
            interleave=True,
        )


def test_tiny_deepseek_through_the_kernels_matches_the_torch_path(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The latent attention layer's CUDA path (mla_prep, head_gemv for the 4-token decode
    batches, the bmm for prefill chunks), run in the interpreter where there is no GPU,
    against the torch path of the same model: the same greedy tokens, close logits."""
    path = write_tiny_model(tmp_path, "deepseek_v2")
    prompts = [[5, 9, 200, 17, 3, 88, 41], [260, 72, 101, 108], [7] * 23, [1, 2]]
    with monkeypatch.context() as torch_path:
        torch_path.setattr(deepseek.MLAttention, "_fused", lambda *args: False)
        model, config = load_model(path, device=DEVICE, attention_backend="triton")
        want = greedy_with_prefix_reuse(model, config, prompts, steps=2)
    calls: list[int] = []
    original = deepseek.MLAttention._forward_fused

    def counted(self: deepseek.MLAttention, *args: Any) -> torch.Tensor:
        calls.append(self.layer_id)
        return original(self, *args)

    monkeypatch.setattr(deepseek.MLAttention, "_forward_fused", counted)
    kernel_device(monkeypatch, layers, deepseek)  # the Rope's kernel cache, the MLA kernels
    model, config = load_model(path, device=DEVICE, attention_backend="triton")
    got = greedy_with_prefix_reuse(model, config, prompts, steps=2)
    assert calls  # the kernels ran
    assert got[0] == want[0]
    torch.testing.assert_close(got[1], want[1], atol=1e-4, rtol=1e-4)
