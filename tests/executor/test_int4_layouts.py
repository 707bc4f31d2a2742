"""AWQ and GPTQ checkpoints (written by the project's quantizer) converted into the w4a16
kernels' layout: exact nibble orders, zero-point conventions, act-order, tensor-parallel K
shards, and the config keys that are accepted or refused."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
import torch

from kernels.w4a16 import pack_int4, w4a16_ref
from services.executor.quant.int4_layouts import (
    Int4Config,
    Int4Weight,
    awq_to_int4,
    gptq_to_int4,
)
from services.executor.quant.int4_quantize import (
    awq_pack,
    awq_tensors,
    gptq_tensors,
    quantize_checkpoint,
)


def weight(n: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.05


def product(iw: Int4Weight, x: torch.Tensor) -> torch.Tensor:
    """x @ w.T through the kernels' torch twin, perm and all."""
    return w4a16_ref(x, iw.qweight, iw.scales, iw.zeros, group_size=iw.group_size, perm=iw.perm)


def test_awq_nibble_order_is_interleaved() -> None:
    # column c of 8 holds c: nibble i of the word holds column (0, 2, 4, 6, 1, 3, 5, 7)[i]
    assert awq_pack(torch.arange(8)[None]).tolist() == [[0x75316420]]
    # and the converter reads it back in plain order
    qweight = awq_pack(torch.arange(8).repeat(16, 1))  # [K=16, N/8=1]: w[n, k] = n
    iw = awq_to_int4(
        qweight,
        awq_pack(torch.zeros(1, 8, dtype=torch.int64)),
        torch.ones(1, 8, dtype=torch.float16),
        group_size=16,
    )
    assert iw.dequantize()[:, 0].tolist() == list(range(8))


def test_gptq_packs_along_k_and_v1_zeros_are_stored_minus_one() -> None:
    # qweight [K/8=1, N=8]: input channel j in nibble j
    qweight = pack_int4(torch.arange(8).repeat(8, 1)).T.contiguous()
    qzeros = pack_int4(torch.tensor([[15, 2, 0, 0, 0, 0, 0, 0]]))  # v1: zeros 16, 3, 1...
    scales = torch.tensor([[1.0, 0.5] + [1.0] * 6], dtype=torch.float16)
    iw = gptq_to_int4(qweight, qzeros, scales, None, group_size=16, zero_offset=1)
    assert iw.perm is None
    assert iw.dequantize()[:2].tolist() == [
        [float(j - 16) for j in range(8)],
        [(j - 3) * 0.5 for j in range(8)],
    ]


@pytest.mark.parametrize("group_size", [128, 64, -1])
def test_awq_round_trip(group_size: int) -> None:
    w = weight(48, 320, seed=1)
    qt = awq_tensors(w, group_size=group_size if group_size > 0 else 320)
    groups = 1 if group_size < 0 else -(-320 // group_size)
    assert {k: tuple(v.shape) for k, v in qt.tensors.items()} == {
        "qweight": (320, 6),
        "qzeros": (groups, 6),
        "scales": (groups, 48),
    }
    iw = awq_to_int4(*qt.tensors.values(), group_size=group_size)
    assert iw.perm is None
    assert torch.equal(iw.dequantize(), qt.dense)
    # round to nearest: within half a step (the step is at most 2 * max|w| / 15 per group)
    assert float((qt.dense - w).abs().max()) <= float(w.abs().max()) / 15 + 1e-3


@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("desc_act", [False, True])
def test_gptq_round_trip(desc_act: bool, sym: bool) -> None:
    w = weight(40, 384, seed=2)
    qt = gptq_tensors(w, group_size=128, desc_act=desc_act, sym=sym)
    assert {k: tuple(v.shape) for k, v in qt.tensors.items()} == {
        "qweight": (48, 40),
        "qzeros": (3, 5),
        "scales": (3, 40),
        "g_idx": (384,),
    }
    g_idx = qt.tensors["g_idx"]
    assert torch.equal(torch.bincount(g_idx), torch.tensor([128, 128, 128]))
    assert torch.equal(g_idx, torch.arange(384, dtype=torch.int32) // 128) != desc_act
    iw = gptq_to_int4(*qt.tensors.values(), group_size=128, zero_offset=1)
    assert torch.equal(iw.dequantize(), qt.dense)
    if desc_act:
        # whole groups of 128 after sorting: a permutation, no padding
        assert iw.perm is not None and iw.group_size == 128
        assert torch.equal(iw.perm.sort().values, torch.arange(384, dtype=torch.int32))
        assert torch.equal(g_idx[iw.perm.long()], torch.arange(384, dtype=torch.int32) // 128)
    else:
        assert iw.perm is None
    x = torch.randn(3, 384, generator=torch.Generator().manual_seed(3))
    torch.testing.assert_close(product(iw, x), x @ qt.dense.T, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    ("bounds", "desc_act"),
    [
        ((0, 256, 512), False),  # shards on group boundaries: each the plain layout
        ((0, 192, 512), False),  # a shard starting mid-group: uneven groups
        ((0, 256, 512), True),  # act-order: every shard holds part of every group
        ((0, 136, 304, 512), True),
    ],
)
def test_row_parallel_shards_of_k(bounds: tuple[int, ...], desc_act: bool) -> None:
    """Each rank converts its K rows with the whole scales and zeros; the shards' partial
    products sum to the whole product, and each dequantises to its columns of the weight."""
    w = weight(24, 512, seed=4)
    x = torch.randn(2, 512, generator=torch.Generator().manual_seed(5))
    gq = gptq_tensors(w, group_size=128, desc_act=desc_act)
    aw = awq_tensors(w, group_size=128)
    for dense, convert in (
        (
            gq.dense,
            lambda k0, k1: gptq_to_int4(
                gq.tensors["qweight"][k0 // 8 : k1 // 8],
                gq.tensors["qzeros"],
                gq.tensors["scales"],
                gq.tensors["g_idx"][k0:k1],
                group_size=128,
                zero_offset=1,
                k_start=k0,
            ),
        ),
        (
            aw.dense,
            lambda k0, k1: awq_to_int4(
                aw.tensors["qweight"][k0:k1],
                aw.tensors["qzeros"],
                aw.tensors["scales"],
                group_size=128,
                k_start=k0,
            ),
        ),
    ):
        if desc_act and dense is aw.dense:
            continue  # AWQ has no act-order
        total = torch.zeros(2, 24)
        for k0, k1 in itertools.pairwise(bounds):
            shard: Int4Weight = convert(k0, k1)
            aligned = k0 % 128 == 0 and not desc_act
            assert (shard.perm is None) == (aligned or not desc_act)
            assert shard.group_size == 128 if aligned else shard.group_size < 128
            assert torch.equal(shard.dequantize(), dense[:, k0:k1])
            total += product(shard, x[:, k0:k1])
        torch.testing.assert_close(total, x @ dense.T, atol=1e-5, rtol=1e-5)


def test_act_order_shard_pads_each_group_run_with_zero_weights() -> None:
    # channels 0..31: groups 1, 0, 1, 0... in runs of one (a worst case): runs padded to 16
    g_idx = (torch.arange(32) % 2 == 0).to(torch.int32)
    q = torch.randint(0, 16, (8, 32), generator=torch.Generator().manual_seed(6))
    zeros = torch.tensor([[3] * 8, [5] * 8])  # [G, N]
    scales = torch.rand(2, 8, dtype=torch.float16) + 0.5
    iw = gptq_to_int4(
        pack_int4(q).T.contiguous(), pack_int4(zeros), scales, g_idx, group_size=32, zero_offset=0
    )
    assert iw.group_size == 16 and iw.perm is not None
    # group 0 (odd channels) then group 1 (even channels), 16 each: no padding needed here
    assert iw.perm.tolist() == list(range(1, 32, 2)) + list(range(0, 32, 2))
    # a shard of 16 channels: 8 of each group, each run padded to 16 with perm -1
    iw = gptq_to_int4(
        pack_int4(q[:, 8:24]).T.contiguous(),
        pack_int4(zeros),
        scales,
        g_idx[8:24],
        group_size=32,
        zero_offset=0,
        k_start=8,
    )
    assert iw.perm is not None and iw.perm.shape == (32,)
    odd, even = list(range(1, 16, 2)), list(range(0, 16, 2))
    assert iw.perm.tolist() == odd + [-1] * 8 + even + [-1] * 8
    x = torch.randn(1, 16)
    gid = g_idx[8:24].long()
    want = x @ ((q[:, 8:24] - zeros[gid].T) * scales[gid].T.float()).T
    torch.testing.assert_close(product(iw, x), want, atol=1e-5, rtol=1e-5)


def test_quantize_checkpoint_names_and_config() -> None:
    sd = {
        "model.embed_tokens.weight": weight(64, 16, 7),
        "model.layers.0.self_attn.q_proj.weight": weight(16, 16, 8),
        "model.layers.0.mlp.down_proj.weight": weight(16, 32, 9),
        "model.layers.0.input_layernorm.weight": torch.ones(16),
        "lm_head.weight": weight(64, 16, 10),
    }
    out, config, reference = quantize_checkpoint(sd, method="gptq", desc_act=True)
    assert config == {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": 128,
        "desc_act": True,
        "sym": True,
        "checkpoint_format": "gptq",
        "static_groups": False,
    }
    quantized = {
        f"model.layers.0.{m}.{t}"
        for m in ("self_attn.q_proj", "mlp.down_proj")
        for t in ("qweight", "qzeros", "scales", "g_idx")
    }
    kept = {"model.embed_tokens.weight", "model.layers.0.input_layernorm.weight", "lm_head.weight"}
    assert set(out) == quantized | kept
    assert set(reference) == set(sd)
    assert reference["lm_head.weight"] is sd["lm_head.weight"]
    cfg = Int4Config.parse(config)
    iw = gptq_to_int4(
        out["model.layers.0.mlp.down_proj.qweight"],
        out["model.layers.0.mlp.down_proj.qzeros"],
        out["model.layers.0.mlp.down_proj.scales"],
        out["model.layers.0.mlp.down_proj.g_idx"],
        group_size=cfg.group_size,
        zero_offset=cfg.zero_offset,
    )
    assert torch.equal(iw.dequantize(), reference["model.layers.0.mlp.down_proj.weight"])
    _, awq_config, _ = quantize_checkpoint(sd, method="awq")
    assert awq_config == {
        "quant_method": "awq",
        "bits": 4,
        "group_size": 128,
        "zero_point": True,
        "version": "gemm",
    }


@pytest.mark.parametrize(
    ("cfg", "want"),
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "GEMM"}, ("awq", 128, 0)),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, ("gptq", -1, 1)),
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 32, "checkpoint_format": "gptq_v2"},
            ("gptq", 32, 0),
        ),
    ],
)
def test_config_accepted(cfg: dict[str, Any], want: tuple[str, int, int]) -> None:
    c = Int4Config.parse(cfg)
    assert (c.method, c.group_size, c.zero_offset) == want


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, r"gptq: only 4-bit"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, r"group_size must be -1 or"),
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, r"awq: only the gemm packing"),
        ({"quant_method": "awq", "bits": 4, "zero_point": False}, r"zero_point=False"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, r"checkpoint_format"),
        ({"quant_method": "fp8"}, r"quant_method must be awq or gptq"),
    ],
)
def test_config_refused(cfg: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        Int4Config.parse(cfg)
