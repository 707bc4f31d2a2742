"""The MoE kernels against their torch twins: fused_moe (a loop over experts), moe_align,
and moe_topk (the executor's select_experts)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import triton

from kernels.fused_moe import fused_moe, fused_moe_ref, quantize_experts
from kernels.moe_align import moe_align, moe_align_ref
from kernels.moe_gemv import moe_gemv
from kernels.moe_topk import moe_topk
from services.executor.models.moe_routing import select_experts
from services.executor.moe_config import MoEConfig
from tests.kernels.helpers import DEVICE, DOT_DTYPES, TOLERANCES, Tol, randn, spread_params

MOE_TOL: dict[torch.dtype, Tol] = {
    torch.float32: {"atol": 1e-5, "rtol": 1e-5},
    torch.float16: {"atol": 2e-3, "rtol": 2e-3},
    torch.bfloat16: {"atol": 2e-2, "rtol": 2e-2},
}


def routing(
    tokens: int, experts: int, top_k: int, gen: torch.Generator, used: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random top-k routing (fp32 weights, int64 ids); `used` experts at most get tokens (the
    others get none)."""
    logits = torch.randn(tokens, experts, generator=gen)
    if used is not None:
        logits[:, used:] = float("-inf")
    weights, ids = logits.softmax(-1).topk(top_k, dim=-1)
    return weights.to(DEVICE), ids.to(DEVICE)


def weights_for(
    experts: int, hidden: int, inter: int, dtype: torch.dtype, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    w13 = randn(experts, 2 * inter, hidden, dtype=dtype, gen=gen, scale=hidden**-0.5)
    w2 = randn(experts, hidden, inter, dtype=dtype, gen=gen, scale=inter**-0.5)
    return w13, w2


# (tokens, experts, top_k, hidden, inter, experts that get tokens)
CPU_SHAPES = [
    (1, 4, 1, 32, 16, None),
    (1, 128, 8, 32, 16, None),  # decode: 8 of 128 experts used
    (5, 8, 3, 48, 24, None),  # hidden and inter not multiples of the tiles
    (7, 16, 2, 32, 40, 3),  # 13 experts with zero tokens
    (33, 4, 4, 16, 16, None),  # top_k = experts: every expert gets every token
    (40, 6, 2, 64, 32, 2),  # more than one block per expert
]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "used"),
    CPU_SHAPES,
    ids=[f"t{s[0]}-e{s[1]}-k{s[2]}-h{s[3]}-i{s[4]}" for s in CPU_SHAPES],
)
def test_matches_reference(
    tokens: int,
    experts: int,
    top_k: int,
    hidden: int,
    inter: int,
    used: int | None,
    dtype: torch.dtype,
) -> None:
    gen = torch.Generator().manual_seed(tokens * 1000 + experts * 10 + top_k)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    w13, w2 = weights_for(experts, hidden, inter, dtype, gen)
    topk_weights, topk_ids = routing(tokens, experts, top_k, gen, used)
    out = fused_moe(
        x, w13, w2, topk_weights, topk_ids, path="grouped", block_m=16, block_n=16, block_k=16
    )
    want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, want, **MOE_TOL[dtype])


# (tokens, experts, top_k, hidden, inter): decode batches, the sizes moe_gemv is for
GEMV_SHAPES = [
    (1, 128, 8, 64, 32),  # Qwen3-MoE's routing: 8 of 128 experts
    (2, 8, 2, 48, 24),  # hidden and inter not multiples of the blocks
    (3, 4, 4, 32, 16),  # top_k = experts: tokens share every expert
    (4, 16, 6, 40, 24),  # top-6 as DeepSeek-V2-Lite, inter deeper than one small K block
]


@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter", "dtype"),
    spread_params(
        GEMV_SHAPES,
        DOT_DTYPES,
        ids=[f"t{s[0]}-e{s[1]}-k{s[2]}-h{s[3]}-i{s[4]}" for s in GEMV_SHAPES],
    ),
)
def test_gemv_path_matches(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    gen = torch.Generator().manual_seed(tokens * 100 + top_k)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    w13, w2 = weights_for(experts, hidden, inter, dtype, gen)
    topk_weights, topk_ids = routing(tokens, experts, top_k, gen)
    want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids.int(), path="gemv")
    torch.testing.assert_close(out, want, **MOE_TOL[dtype])
    small = moe_gemv(x, w13, w2, topk_weights, topk_ids, block_n=4, block_k=16)
    torch.testing.assert_close(small, want, **MOE_TOL[dtype])  # several K steps, masked rows


def test_auto_path_is_the_grouped_gemm() -> None:
    """moe_gemv runs only when asked for (measured slower at batch 1 on an H200)."""
    gen = torch.Generator().manual_seed(11)
    x = randn(1, 32, dtype=torch.float32, gen=gen)
    w13, w2 = weights_for(8, 32, 16, torch.float32, gen)
    topk_weights, topk_ids = routing(1, 8, 2, gen)
    grouped = fused_moe(x, w13, w2, topk_weights, topk_ids, path="grouped")
    gemv = fused_moe(x, w13, w2, topk_weights, topk_ids, path="gemv")
    assert torch.equal(fused_moe(x, w13, w2, topk_weights, topk_ids), grouped)
    torch.testing.assert_close(gemv, grouped, **MOE_TOL[torch.float32])


@pytest.mark.parametrize("ids_dtype", [torch.int32, torch.int64])
def test_one_token_takes_its_experts_without_sorting(
    ids_dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A batch-1 decode step: no align launch, each of the token's experts its own block;
    two tokens still sort."""
    import kernels.fused_moe

    aligned: list[int] = []

    def counted(topk_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        aligned.append(topk_ids.shape[0])
        return moe_align(topk_ids, *args, **kwargs)

    monkeypatch.setattr(kernels.fused_moe, "moe_align", counted)
    gen = torch.Generator().manual_seed(21)
    w13, w2 = weights_for(32, 48, 40, torch.float32, gen)  # hidden, inter: partial tiles
    for tokens in (1, 2):
        x = randn(tokens, 48, dtype=torch.float32, gen=gen)
        topk_weights, topk_ids = routing(tokens, 32, 6, gen)
        out = fused_moe(x, w13, w2, topk_weights, topk_ids.to(ids_dtype), path="grouped")
        want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
        torch.testing.assert_close(out, want, **MOE_TOL[torch.float32])
    assert aligned == [2]


def test_int32_ids_and_default_tiles_match() -> None:
    gen = torch.Generator().manual_seed(3)
    x = randn(6, 64, dtype=torch.float32, gen=gen)
    w13, w2 = weights_for(8, 64, 64, torch.float32, gen)
    topk_weights, topk_ids = routing(6, 8, 2, gen)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids.int())
    want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(out, want, **TOLERANCES[torch.float32])


def test_no_tokens_gives_an_empty_output() -> None:
    gen = torch.Generator().manual_seed(4)
    w13, w2 = weights_for(4, 32, 16, torch.float32, gen)
    x = torch.empty(0, 32, device=DEVICE)
    ids = torch.empty(0, 2, dtype=torch.int64, device=DEVICE)
    out = fused_moe(x, w13, w2, torch.empty(0, 2, device=DEVICE), ids)
    assert out.shape == (0, 32)


def runs(sorted_ids: torch.Tensor, block_m: int, total: int) -> list[list[int]]:
    """Each block's pairs, sorted: the order inside a one-block run is unspecified."""
    ids = sorted_ids.tolist()
    return [sorted(ids[b : b + block_m]) for b in range(0, total, block_m)]


def expert_runs(
    sorted_ids: torch.Tensor, expert_ids: torch.Tensor, block_m: int
) -> dict[int, list[int]]:
    """Each expert's entries over all its blocks, sorted: with the three-launch path's atomics,
    which of an expert's blocks a pair lands in is unspecified on a GPU."""
    ids = sorted_ids.tolist()
    out: dict[int, list[int]] = {}
    for b, expert in enumerate(expert_ids.tolist()):
        if expert >= 0:
            out.setdefault(expert, []).extend(ids[b * block_m : (b + 1) * block_m])
    return {e: sorted(v) for e, v in out.items()}


def test_align_groups_pairs_by_expert_in_padded_blocks() -> None:
    ids = torch.tensor([[0, 2], [2, 3], [0, 2]], device=DEVICE)  # pairs 0..5
    sorted_ids, expert_ids, total = moe_align(ids, num_experts=5, block_m=4)
    pad = 6
    # expert 0: pairs 0, 4; expert 2: 1, 2, 5; expert 3: 3; experts 1 and 4: none
    assert runs(sorted_ids, 4, 12) == [[0, 4, pad, pad], [1, 2, 5, pad], [3, pad, pad, pad]]
    assert sorted_ids[12:].tolist() == [pad] * 12
    assert expert_ids.tolist() == [0, 2, 3, -1, -1, -1]
    assert total.tolist() == [12]


ALIGN_CASES = [
    (1, 128, 8, 16),
    (16, 128, 8, 16),  # the largest one-launch decode batch of Qwen3-30B-A3B
    (9, 16, 4, 16),
    (40, 6, 2, 64),
    (300, 60, 6, 32),
    (2, 3, 3, 16),
]


@pytest.mark.parametrize("one_program", [True, False], ids=["one-launch", "three-launch"])
@pytest.mark.parametrize(("tokens", "experts", "top_k", "block_m"), ALIGN_CASES)
def test_align_matches_reference(
    tokens: int, experts: int, top_k: int, block_m: int, one_program: bool
) -> None:
    cells = max(16, triton.next_power_of_2(tokens * top_k)) * triton.next_power_of_2(experts)
    if one_program and cells > 16384:
        pytest.skip("too large for one program (moe_align never chooses it)")
    gen = torch.Generator().manual_seed(tokens + experts)
    _, ids = routing(tokens, experts, top_k, gen, used=max(top_k, experts // 2))
    got = moe_align(ids, experts, block_m, one_program=one_program)
    want = moe_align_ref(ids, experts, block_m)
    for g, w in zip(got[1:], want[1:], strict=True):
        assert torch.equal(g, w)
    total = int(want[2])
    assert expert_runs(got[0], got[1], block_m) == expert_runs(want[0], want[1], block_m)
    assert torch.equal(got[0][total:], want[0][total:])


def test_align_shapes_do_not_depend_on_the_routing() -> None:
    """A CUDA graph captured for one routing replays for any other."""
    gen = torch.Generator().manual_seed(5)
    shapes = set()
    for used in (4, 5, 16):
        _, ids = routing(9, 16, 4, gen, used=used)
        sorted_ids, expert_ids, total = moe_align(ids, 16, 16)
        shapes.add((sorted_ids.shape, expert_ids.shape, total.shape))
        valid = sorted_ids[sorted_ids < 36]
        assert sorted(valid.tolist()) == list(range(36))  # every pair exactly once
    assert len(shapes) == 1


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"x": torch.zeros(2, 3, 4)}, ValueError, r"x must have shape \[tokens, hidden\]"),
        ({"w13": torch.zeros(4, 15, 32)}, ValueError, r"w13's rows must be even"),
        ({"w2": torch.zeros(4, 32, 8)}, ValueError, r"w2 must have shape"),
        ({"topk_weights": torch.zeros(3, 2, dtype=torch.float16)}, TypeError, r"topk_weights"),
        ({"topk_ids": torch.zeros(3, 2)}, TypeError, r"topk_ids must be one of"),
        ({"block_n": 24}, ValueError, r"block_n must be a power of two"),
        ({"path": "fast"}, ValueError, r"path must be 'auto', 'grouped' or 'gemv'"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    args = {
        "x": torch.zeros(3, 32),
        "w13": torch.zeros(4, 32, 32),
        "w2": torch.zeros(4, 32, 16),
        "topk_weights": torch.zeros(3, 2),
        "topk_ids": torch.zeros(3, 2, dtype=torch.int64),
    }
    block_n = kwargs.pop("block_n", 16)
    path = kwargs.pop("path", "grouped")
    args.update(kwargs)
    t = {k: v.to(DEVICE) for k, v in args.items()}
    with pytest.raises(error, match=match):
        fused_moe(
            t["x"], t["w13"], t["w2"], t["topk_weights"], t["topk_ids"], block_n=block_n, path=path
        )


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_qwen3_30b_shapes_on_the_gpu(tokens: int, dtype: torch.dtype) -> None:
    """Qwen3-30B-A3B: 128 experts, top-8, hidden 2048, expert intermediate 768."""
    gen = torch.Generator().manual_seed(tokens)
    x = randn(tokens, 2048, dtype=dtype, gen=gen)
    w13, w2 = weights_for(128, 2048, 768, dtype, gen)
    topk_weights, topk_ids = routing(tokens, 128, 8, gen)
    out = fused_moe(x, w13, w2, topk_weights, topk_ids)
    want = fused_moe_ref(x, w13, w2, topk_weights, topk_ids)
    torch.testing.assert_close(out, want, **MOE_TOL[dtype])


@pytest.mark.gpu
def test_routing_and_experts_never_synchronise_and_replay_in_a_graph() -> None:
    """What a decode step runs per MoE layer: moe_topk, then fused_moe (moe_align inside)."""
    gen = torch.Generator().manual_seed(7)
    x = randn(4, 256, dtype=torch.bfloat16, gen=gen)
    w13, w2 = weights_for(32, 256, 128, torch.bfloat16, gen)
    logits = randn(4, 32, dtype=torch.float32, gen=gen)  # fp32: no ties for topk to break

    def layer() -> torch.Tensor:
        weights, ids = moe_topk(logits, top_k=4, renormalise=True)
        return fused_moe(x, w13, w2, weights, ids)

    layer()  # compile outside the checks
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        layer()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    logits.copy_(randn(4, 32, dtype=torch.float32, gen=gen))  # another routing, same shapes
    graph.replay()
    weights, ids = logits.float().softmax(-1).topk(4)
    want = fused_moe_ref(x, w13, w2, weights / weights.sum(-1, keepdim=True), ids)
    torch.testing.assert_close(out, want, **MOE_TOL[torch.bfloat16])


# (tokens, experts, top_k, scoring, renormalise, scale)
TOPK_CASES = [
    (1, 128, 8, "softmax", True, 1.0),  # Qwen3-30B-A3B
    (5, 60, 4, "softmax", False, 1.0),  # Qwen1.5-MoE: 60 experts, not a power of two
    (7, 8, 2, "softmax", True, 1.0),  # Mixtral
    (3, 64, 6, "softmax", False, 1.0),  # DeepSeek-V2-Lite (greedy)
    (4, 16, 1, "sigmoid", True, 2.5),
    (2, 4, 4, "sigmoid", False, 1.0),  # every expert
]


def routing_config(experts: int, top_k: int, scoring: str, renorm: bool, scale: float) -> MoEConfig:
    return MoEConfig(
        num_experts=experts,
        top_k=top_k,
        intermediate_size=8,
        sparse_layers=(0,),
        scoring=scoring,
        norm_topk_prob=renorm,
        routed_scaling_factor=scale,
    )


@pytest.mark.parametrize(("tokens", "experts", "top_k", "scoring", "renorm", "scale"), TOPK_CASES)
def test_topk_matches_select_experts(
    tokens: int, experts: int, top_k: int, scoring: str, renorm: bool, scale: float
) -> None:
    moe = routing_config(experts, top_k, scoring, renorm, scale)
    logits = randn(tokens, experts, dtype=torch.float32, gen=torch.Generator().manual_seed(top_k))
    weights, ids = moe_topk(logits, top_k=top_k, scoring=scoring, renormalise=renorm, scale=scale)
    want_weights, want_ids = select_experts(logits.cpu(), moe)
    assert ids.dtype == torch.int32
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("extra", "renorm", "scale"), [(2, False, 1.0), (1, True, 2.5)])
def test_topk_extra_slots_are_the_shared_experts(extra: int, renorm: bool, scale: float) -> None:
    """extra: each token's top_k, then experts E, E + 1, ... with weight 1 (neither
    renormalised nor scaled), as select_experts appends them."""
    tokens, experts, top_k = 5, 64, 6
    moe = routing_config(experts, top_k, "softmax", renorm, scale)
    logits = randn(tokens, experts, dtype=torch.float32, gen=torch.Generator().manual_seed(9))
    kw: dict[str, Any] = {"top_k": top_k, "renormalise": renorm, "scale": scale}
    weights, ids = moe_topk(logits, extra=extra, **kw)
    plain_weights, plain_ids = moe_topk(logits, **kw)
    assert ids.shape == weights.shape == (tokens, top_k + extra)
    assert torch.equal(ids[:, :top_k], plain_ids) and torch.equal(weights[:, :top_k], plain_weights)
    shared = torch.arange(experts, experts + extra, dtype=torch.int32, device=ids.device)
    assert torch.equal(ids[:, top_k:], shared.expand(tokens, extra))
    assert bool((weights[:, top_k:] == 1.0).all())
    want_weights, want_ids = select_experts(logits.cpu(), moe, extra=extra)
    assert torch.equal(ids.cpu().long(), want_ids)
    torch.testing.assert_close(weights.cpu(), want_weights, atol=1e-6, rtol=1e-6)


def test_topk_reads_bf16_logits() -> None:
    logits = randn(3, 32, dtype=torch.bfloat16, gen=torch.Generator().manual_seed(1))
    weights, ids = moe_topk(logits, top_k=4, renormalise=True)
    want = logits.float().softmax(-1).topk(4)
    # bf16 logits tie; tied experts may come in either order
    order, want_order = ids.long().argsort(-1), want.indices.argsort(-1)
    assert torch.equal(ids.long().gather(1, order), want.indices.gather(1, want_order))
    want_weights = (want.values / want.values.sum(-1, keepdim=True)).gather(1, want_order)
    torch.testing.assert_close(weights.gather(1, order), want_weights)


@pytest.mark.parametrize("tokens", [1, 5])
def test_unreduced_rows_sum_to_the_reduced_output(tokens: int) -> None:
    """reduce=False: each token's top_k weighted expert rows, [tokens, top_k, hidden]; added
    in order, they are reduce=True's output bit for bit (the norm after adds them so)."""
    from tests.kernels.test_rmsnorm import sequential_sum

    gen = torch.Generator().manual_seed(31)
    x = randn(tokens, 48, dtype=torch.float32, gen=gen)
    w13, w2 = weights_for(16, 48, 40, torch.float32, gen)
    topk_weights, topk_ids = routing(tokens, 16, 4, gen)
    rows = fused_moe(x, w13, w2, topk_weights, topk_ids, reduce=False)
    assert rows.shape == (tokens, 4, 48)
    assert torch.equal(sequential_sum(rows), fused_moe(x, w13, w2, topk_weights, topk_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("tokens", [1, 5])
def test_add_lands_in_the_sum_as_a_separate_add_would(tokens: int, dtype: torch.dtype) -> None:
    """add= (a shared expert's output): the same bits as fused_moe(...) + add, whose sum is
    rounded before the add; in one launch, for one token (DIRECT) and several (sorted), and
    from a strided add. The gemv path adds it too."""
    gen = torch.Generator().manual_seed(37 + tokens)
    x = randn(tokens, 48, dtype=dtype, gen=gen)
    w13, w2 = weights_for(16, 48, 40, dtype, gen)
    topk_weights, topk_ids = routing(tokens, 16, 4, gen)
    shared = randn(tokens, 64, dtype=dtype, gen=gen)[:, :48]  # row stride 64
    want = fused_moe(x, w13, w2, topk_weights, topk_ids) + shared
    got = fused_moe(x, w13, w2, topk_weights, topk_ids, add=shared)
    assert torch.equal(got, want)
    assert not torch.equal(got, fused_moe(x, w13, w2, topk_weights, topk_ids))
    gemv_path = fused_moe(x, w13, w2, topk_weights, topk_ids, add=shared, path="gemv")
    torch.testing.assert_close(gemv_path, want, **MOE_TOL[dtype])
    with pytest.raises(ValueError, match="add needs reduce=True"):
        fused_moe(x, w13, w2, topk_weights, topk_ids, add=shared, reduce=False)
    with pytest.raises(ValueError, match="add"):
        fused_moe(x, w13, w2, topk_weights, topk_ids, add=shared[:, :40])


def fp8_experts(
    experts: int, hidden: int, inter: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random experts quantized as an fp8 checkpoint holds them: e4m3 with a scale per
    128x128 block, gate's and up's blocks apart (services/executor/quant/fp8_checkpoint.py),
    as (q13, s13, q2, s2)."""
    w13, w2 = weights_for(experts, hidden, inter, torch.float32, gen)
    q13, q2, s13, s2 = quantize_experts(w13.cpu(), w2.cpu())
    return q13.to(DEVICE), s13.to(DEVICE), q2.to(DEVICE), s2.to(DEVICE)


# (tokens, experts, top_k, hidden, inter): gate/up's blocks apart where I is not a multiple of
# 128 (its last block row partial), several blocks along both dimensions, one token (DIRECT)
FP8_SHAPES = [(1, 8, 2, 256, 192), (6, 4, 2, 384, 256), (20, 8, 3, 256, 160)]


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(
    ("tokens", "experts", "top_k", "hidden", "inter"),
    FP8_SHAPES,
    ids=[f"t{s[0]}-e{s[1]}-k{s[2]}-h{s[3]}-i{s[4]}" for s in FP8_SHAPES],
)
def test_fp8_block_experts_match_their_dequantized_weights(
    tokens: int, experts: int, top_k: int, hidden: int, inter: int, dtype: torch.dtype
) -> None:
    """Each tile's product with the widened e4m3 weights, scaled by its block's scale, equals
    the product with the dequantized weights, within the float type's rounding."""
    gen = torch.Generator().manual_seed(tokens + 7 * inter)
    x = randn(tokens, hidden, dtype=dtype, gen=gen)
    q13, s13, q2, s2 = fp8_experts(experts, hidden, inter, gen)
    topk_weights, topk_ids = routing(tokens, experts, top_k, gen)
    tiles: dict[str, Any] = {"block_m": 16, "block_n": 32, "block_k": 64}
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2, **tiles)
    want = fused_moe_ref(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2)
    assert out.shape == (tokens, hidden) and out.dtype == dtype
    torch.testing.assert_close(out, want, **MOE_TOL[dtype])
    # and the scales are applied where they belong: doubling up's scales changes the answer
    s13_up = s13.clone()
    s13_up[:, -(-inter // 128) :] *= 2
    moved = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=s13_up, w2_scale=s2, **tiles)
    want_moved = fused_moe_ref(x, q13, q2, topk_weights, topk_ids, w13_scale=s13_up, w2_scale=s2)
    torch.testing.assert_close(moved, want_moved, **MOE_TOL[dtype])
    assert not torch.allclose(moved, out, **MOE_TOL[dtype])


def fp8_row_experts(
    experts: int, hidden: int, inter: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random experts in e4m3 with one scale per row (compressed-tensors' per-channel fp8), as
    (q13, s13, q2, s2)."""
    w13, w2 = weights_for(experts, hidden, inter, torch.float32, gen)
    q13, q2, s13, s2 = quantize_experts(w13.cpu(), w2.cpu(), rows=True)
    return q13.to(DEVICE), s13.to(DEVICE), q2.to(DEVICE), s2.to(DEVICE)


@pytest.mark.parametrize("dtype", DOT_DTYPES)
@pytest.mark.parametrize(("tokens", "inter"), [(1, 48), (9, 40)], ids=["t1-i48", "t9-i40"])
def test_fp8_row_scaled_experts_match_their_dequantized_weights(
    tokens: int, inter: int, dtype: torch.dtype
) -> None:
    """Per-row scales multiply each row's finished sums (gate's and up's rows their own);
    any tiles, rows and columns not multiples of them."""
    gen = torch.Generator().manual_seed(tokens + inter)
    x = randn(tokens, 96, dtype=dtype, gen=gen)
    q13, s13, q2, s2 = fp8_row_experts(6, 96, inter, gen)
    topk_weights, topk_ids = routing(tokens, 6, 2, gen)
    tiles: dict[str, Any] = {"block_m": 16, "block_n": 16, "block_k": 32}
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2, **tiles)
    want = fused_moe_ref(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out, want, **MOE_TOL[dtype])
    up = s13.clone()
    up[:, inter:] *= 2  # up's own rows: the answer moves
    moved = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=up, w2_scale=s2, **tiles)
    torch.testing.assert_close(
        moved, fused_moe_ref(x, q13, q2, topk_weights, topk_ids, w13_scale=up, w2_scale=s2),
        **MOE_TOL[dtype],
    )  # fmt: skip
    assert not torch.allclose(moved, out, **MOE_TOL[dtype])


def test_fp8_experts_refuse_what_their_scales_cannot_take() -> None:
    gen = torch.Generator().manual_seed(3)
    q13, s13, q2, s2 = fp8_experts(4, 256, 128, gen)
    x = randn(2, 256, dtype=torch.bfloat16, gen=gen)
    w, ids = routing(2, 4, 2, gen)
    with pytest.raises(ValueError, match="need both w13_scale and w2_scale"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13)
    with pytest.raises(ValueError, match=r"w2_scale must have shape"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2[:, :1])
    with pytest.raises(ValueError, match="grouped path, not 'gemv'"):
        fused_moe(x, q13, q2, w, ids, w13_scale=s13, w2_scale=s2, path="gemv")
    with pytest.raises(TypeError, match="w13 must be one of"):
        fused_moe(x, q13.to(torch.bfloat16), q2, w, ids, w13_scale=s13, w2_scale=s2)


@pytest.mark.gpu
@pytest.mark.parametrize("tokens", [1, 4, 64, 512])
def test_fp8_qwen3_30b_shapes_on_the_gpu(tokens: int) -> None:
    """Qwen3-30B-A3B-FP8's experts (128 of 768 x 2048, 128x128 blocks) with the default
    tiles of each batch size (one token's DIRECT path, decode, prefill)."""
    gen = torch.Generator().manual_seed(tokens)
    x = randn(tokens, 2048, dtype=torch.bfloat16, gen=gen)
    q13, s13, q2, s2 = fp8_experts(128, 2048, 768, gen)
    topk_weights, topk_ids = routing(tokens, 128, 8, gen)
    out = fused_moe(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2)
    want = fused_moe_ref(x, q13, q2, topk_weights, topk_ids, w13_scale=s13, w2_scale=s2)
    torch.testing.assert_close(out, want, **MOE_TOL[torch.bfloat16])
