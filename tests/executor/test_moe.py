"""Routing and the SparseMoE layer against transformers' own MoE modules (float32), and
MoEConfig read from each family's config."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import (
    DeepseekV2Config,
    DeepseekV3Config,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Moe
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from services.executor.model_config import ModelConfig
from services.executor.models.moe import SparseMoE
from services.executor.models.moe_routing import select_experts
from services.executor.moe_config import MoEConfig
from tests.executor.helpers import write_tiny_model
from tests.kernels.helpers import kernel_device

HIDDEN = 32
TOKENS = 23
COMMON: dict[str, Any] = {"hidden_size": HIDDEN, "num_hidden_layers": 4, "hidden_act": "silu"}

# name -> (transformers config, its MoE block class)
FAMILIES: dict[str, tuple[Any, type[torch.nn.Module]]] = {
    "qwen2-moe-shared-gated": (
        Qwen2MoeConfig(
            num_experts=8,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=24,
            norm_topk_prob=False,
            **COMMON,
        ),
        Qwen2MoeSparseMoeBlock,
    ),
    "qwen3-moe-renormalised": (
        Qwen3MoeConfig(
            num_experts=16,
            num_experts_per_tok=8,
            moe_intermediate_size=16,
            norm_topk_prob=True,
            **COMMON,
        ),
        Qwen3MoeSparseMoeBlock,
    ),
    "mixtral-top1": (
        MixtralConfig(num_local_experts=4, num_experts_per_tok=1, intermediate_size=16, **COMMON),
        MixtralSparseMoeBlock,
    ),
    "deepseek-v2-group-limited": (
        DeepseekV2Config(
            n_routed_experts=16,
            num_experts_per_tok=3,
            moe_intermediate_size=16,
            n_shared_experts=2,
            topk_method="group_limited_greedy",
            n_group=4,
            topk_group=2,
            routed_scaling_factor=1.5,
            **COMMON,
        ),
        DeepseekV2Moe,
    ),
    "deepseek-v2-greedy": (
        DeepseekV2Config(
            n_routed_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            n_shared_experts=1,
            topk_method="greedy",
            **COMMON,
        ),
        DeepseekV2Moe,
    ),
    "deepseek-v3-noaux-tc": (
        DeepseekV3Config(
            n_routed_experts=16,
            num_experts_per_tok=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            **COMMON,
        ),
        DeepseekV3MoE,
    ),
}


def model_config(moe: MoEConfig) -> ModelConfig:
    """The ModelConfig fields SparseMoE reads (hidden_size, moe) around the rest of a shape."""
    return ModelConfig(
        architecture="Qwen3MoeForCausalLM",
        vocab_size=64,
        hidden_size=HIDDEN,
        intermediate_size=64,
        num_layers=4,
        num_heads=2,
        num_kv_heads=2,
        head_dim=16,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        max_position_embeddings=128,
        tie_word_embeddings=False,
        attention_bias=False,
        qk_norm=True,
        bos_token_id=None,
        eos_token_ids=(),
        torch_dtype="float32",
        moe=moe,
    )


def hf_block(name: str, seed: int = 0) -> tuple[torch.nn.Module, MoEConfig]:
    """transformers' MoE block with random weights (and correction bias), and our config."""
    hf_config, cls = FAMILIES[name]
    torch.manual_seed(seed)
    block = cls(hf_config).eval()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in [*block.parameters(), *block.buffers()]:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    moe = MoEConfig.from_hf(hf_config.to_dict())
    assert moe is not None
    return block, moe


def load_ours(block: torch.nn.Module, moe: MoEConfig) -> SparseMoE:
    """Our layer with the HF block's weights (its experts are stacked the way ours are)."""
    ours = SparseMoE(model_config(moe), layer_id=3).eval()
    hf = dict(block.named_parameters()) | dict(block.named_buffers())
    with torch.no_grad():
        ours.gate.weight.copy_(hf["gate.weight"])
        if ours.gate.e_score_correction_bias is not None:
            ours.gate.e_score_correction_bias.copy_(hf["gate.e_score_correction_bias"])
        ours.experts.w13_weight.copy_(hf["experts.gate_up_proj"])
        ours.experts.w2_weight.copy_(hf["experts.down_proj"])
        for shared in ("shared_expert", "shared_experts"):
            if f"{shared}.gate_proj.weight" in hf:
                mlp = getattr(ours, shared)
                parts = [hf[f"{shared}.{proj}.weight"] for proj in ("gate_proj", "up_proj")]
                gate_up = torch.cat(parts)
                mlp.gate_up_proj.weight.copy_(gate_up)
                mlp.down_proj.weight.copy_(hf[f"{shared}.down_proj.weight"])
        if ours.shared_expert_gate is not None:
            ours.shared_expert_gate.weight.copy_(hf["shared_expert_gate.weight"])
    return ours


def by_expert(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each token's (weights, ids) ordered by expert id: HF's grouped top-k is unsorted."""
    order = ids.argsort(dim=-1)
    return weights.float().gather(1, order), ids.gather(1, order)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_routing_matches_transformers_router(name: str) -> None:
    block, moe = hf_block(name)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits, hf_weights, hf_ids = block.get_submodule("gate")(x)
    bias = getattr(block.gate, "e_score_correction_bias", None)
    weights, ids = select_experts(logits, moe, bias)
    assert weights.dtype == torch.float32 and ids.shape == (TOKENS, moe.top_k)
    got_w, got_ids = by_expert(weights, ids)
    want_w, want_ids = by_expert(hf_weights, hf_ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got_w, want_w, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", list(FAMILIES))
def test_sparse_moe_matches_transformers_block(name: str) -> None:
    block, moe = hf_block(name, seed=2)
    ours = load_ours(block, moe)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(3))
    got, want = both_outputs(block, ours, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def both_outputs(
    block: torch.nn.Module, ours: SparseMoE, x: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ours(x), the HF block's output for x), on the CPU; ours runs where its weights are
    (kernel_device)."""
    with torch.no_grad():
        want = block(x[None].cpu())
        got = ours(x.to(ours.gate.weight.device)).cpu()
        return got, (want[0] if isinstance(want, tuple) else want)[0]


def _has_shared_experts(name: str) -> bool:
    moe = MoEConfig.from_hf(FAMILIES[name][0].to_dict())
    return moe is not None and moe.shared_intermediate_size > 0


SHARED = [name for name in FAMILIES if _has_shared_experts(name)]


@pytest.mark.parametrize("name", SHARED)
def test_shared_experts_join_the_kernel_sum(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path (kernels/fused_moe in the interpreter where there is no GPU): the
    shared expert's output goes into fused_moe's sum launch (`add`) and the block still
    matches transformers'."""
    import kernels.fused_moe
    from services.executor.models import moe as moe_module

    adds = []
    original = kernels.fused_moe.fused_moe

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        adds.append(kwargs.get("add"))
        return original(*args, **kwargs)

    device = kernel_device(monkeypatch, moe_module)
    monkeypatch.setattr(kernels.fused_moe, "fused_moe", spy)
    block, moe = hf_block(name, seed=4)
    ours = load_ours(block, moe).to(device)
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(6))
    got, want = both_outputs(block, ours, x)
    assert len(adds) == 1 and adds[0] is not None and adds[0].shape == (TOKENS, HIDDEN)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_grouped_routing_keeps_to_the_best_groups() -> None:
    """noaux_tc: experts outside the topk_group best groups (ranked by their two best
    corrected scores) are never chosen, even when their own score is higher."""
    moe = MoEConfig(
        num_experts=8,
        top_k=2,
        intermediate_size=4,
        sparse_layers=(0,),
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=4,
        topk_group=1,
        correction_bias=True,
        norm_topk_prob=True,
    )
    # groups {0,1} {2,3} {4,5} {6,7}: expert 0 is the best single expert, group {6,7} the
    # best pair once the bias is added.
    logits = torch.tensor([[5.0, -5.0, 0.0, 0.0, 0.0, 0.0, 1.0, 1.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.5, 0.5])
    weights, ids = select_experts(logits, moe, bias)
    assert sorted(ids[0].tolist()) == [6, 7]
    torch.testing.assert_close(weights, torch.tensor([[0.5, 0.5]]))  # bias not in weights


def test_config_reads_sparse_layers_of_each_family() -> None:
    qwen = Qwen3MoeConfig(num_hidden_layers=6, decoder_sparse_step=2, mlp_only_layers=[3])
    moe = MoEConfig.from_hf(qwen.to_dict())
    assert moe is not None and moe.sparse_layers == (1, 5)
    v3 = DeepseekV3Config(num_hidden_layers=5, first_k_dense_replace=2)
    moe = MoEConfig.from_hf(v3.to_dict())
    assert moe is not None
    assert moe.sparse_layers == (2, 3, 4)
    assert (moe.scoring, moe.topk_method, moe.correction_bias) == ("sigmoid", "noaux_tc", True)
    assert (moe.n_group, moe.topk_group, moe.routed_scaling_factor) == (8, 4, 2.5)
    assert moe.shared_intermediate_size == v3.moe_intermediate_size and not moe.shared_gate
    assert moe.router_fp32
    mixtral = MoEConfig.from_hf(MixtralConfig(num_hidden_layers=2).to_dict())
    assert mixtral is not None and mixtral.norm_topk_prob and mixtral.sparse_layers == (0, 1)
    assert MoEConfig.from_hf({"num_hidden_layers": 2, "intermediate_size": 8}) is None


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"scoring": "tanh"}, "unsupported MoE scoring"),
        ({"topk_method": "best"}, "unsupported MoE top-k"),
        ({"top_k": 9}, "top_k 9"),
        ({"n_group": 3}, "n_group must divide"),
    ],
)
def test_config_rejects_what_it_cannot_route(fields: dict[str, Any], match: str) -> None:
    base: dict[str, Any] = {
        "num_experts": 8,
        "top_k": 2,
        "intermediate_size": 4,
        "sparse_layers": (0,),
    }
    with pytest.raises(Exception, match=match):
        MoEConfig(**(base | fields))


def test_model_config_of_each_moe_family(tmp_path: Path) -> None:
    qwen2 = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "qwen2_moe"))
    assert qwen2.architecture == "Qwen2MoeForCausalLM"
    assert (qwen2.attention_bias, qwen2.o_proj_bias, qwen2.qk_norm) == (True, False, False)
    assert qwen2.moe == MoEConfig(
        num_experts=8,
        top_k=2,
        intermediate_size=32,
        sparse_layers=(0, 1),
        shared_intermediate_size=48,
        shared_gate=True,
    )
    qwen3 = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "qwen3_moe", decoder_sparse_step=2))
    assert (qwen3.architecture, qwen3.attention_bias, qwen3.qk_norm) == (
        "Qwen3MoeForCausalLM",
        False,
        True,
    )
    assert qwen3.moe is not None and qwen3.moe.sparse_layers == (1,)
    assert qwen3.moe.norm_topk_prob and qwen3.moe.shared_intermediate_size == 0
    mixtral = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "mixtral", sliding_window=100))
    assert mixtral.architecture == "MixtralForCausalLM"
    assert mixtral.max_position_embeddings == 512  # the whole context, through the window
    assert [mixtral.layer_window(i) for i in range(mixtral.num_layers)] == [100, 100]
    assert mixtral.moe is not None and mixtral.moe.intermediate_size == 128
    dense = ModelConfig.from_hf_dir(write_tiny_model(tmp_path, "qwen3"))
    assert dense.moe is None


@pytest.mark.parametrize("name", list(FAMILIES))
def test_a_deferred_sum_leaves_the_next_norm_unchanged(
    name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """defer_sum: on CUDA (the kernels, interpreted here) a layer without shared experts
    hands the next residual norm its experts' unsummed rows, one launch fewer; that norm's
    output and new residual are the summed layer's."""
    import services.executor.models.layers as layers
    import services.executor.models.moe as moe_module
    from services.executor.models.layers import RMSNorm

    device = kernel_device(monkeypatch, layers, moe_module)
    block, moe = hf_block(name, seed=4)
    ours = load_ours(block, moe).to(device)
    gen = torch.Generator().manual_seed(5)
    x, residual = torch.randn(2, TOKENS, HIDDEN, generator=gen).to(device)
    norm = RMSNorm(HIDDEN, 1e-6).to(device)
    with torch.no_grad():
        summed = ours(x)
        ours.defer_sum = True
        deferred = ours(x)
        assert deferred.dim() == (2 if moe.shared_intermediate_size else 3)
        want, got = norm(summed, residual), norm(deferred, residual)
    torch.testing.assert_close(got[0], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(got[1], want[1], atol=1e-6, rtol=1e-6)


def test_fp32_router_logits_through_the_decode_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSeek's router (router_fp32) with bf16 weights: logits in fp32 from F.linear of the
    widened x and weight on the dense path, and from kernels/gemv's fp32 output (no widened
    copies) for the row counts choose_gemv gave it; the two agree to fp32 summation order."""
    from services.executor.models.linear import CANDIDATES, FP32_PRODUCTS

    _, moe = hf_block("deepseek-v2-greedy")
    assert moe.router_fp32
    device = kernel_device(monkeypatch)  # the Linear's kernel path asks for a plan only
    ours = SparseMoE(model_config(moe), layer_id=3).to(torch.bfloat16).eval().to(device)
    assert ours.gate.method is FP32_PRODUCTS
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        ours.gate.weight.copy_(torch.randn(ours.gate.weight.shape, generator=gen))
    x = torch.randn(2, HIDDEN, generator=gen).to(torch.bfloat16).to(device)
    want = torch.nn.functional.linear(x.float(), ours.gate.weight.float())
    with torch.no_grad():
        dense = ours.gate(x)
        ours.gate.gemv_plan = {2: CANDIDATES[0]}
        kernel = ours.gate(x)
    assert dense.dtype == kernel.dtype == torch.float32
    torch.testing.assert_close(dense, want, atol=0.0, rtol=0.0)
    torch.testing.assert_close(kernel, want, atol=1e-5, rtol=1e-5)
    assert not torch.equal(kernel, want.to(torch.bfloat16).float())  # not rounded to bf16


@pytest.mark.parametrize("name", SHARED)
@pytest.mark.parametrize("kernels", [False, True], ids=["torch", "kernels"])
def test_shared_experts_stored_as_routed_ones_match_transformers(
    name: str, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """fuse_shared_experts: DeepSeek's shared experts become experts E.. with weight 1 (the
    shared module is gone, the stacks longer), and the block still matches transformers',
    through torch and through the CUDA path's kernels (the interpreter without a GPU);
    Qwen2-MoE's gated shared expert stays as it was. after_loading fuses on CUDA only."""
    from services.executor.models import moe as moe_module

    device = kernel_device(monkeypatch, moe_module) if kernels else torch.device("cpu")
    block, moe = hf_block(name, seed=7)
    ours = load_ours(block, moe).to(device)
    if not kernels:
        ours.after_loading()  # on the CPU: nothing changes
        assert ours.shared_slots == 0
    ours.fuse_shared_experts()
    x = torch.randn(TOKENS, HIDDEN, generator=torch.Generator().manual_seed(8))
    got, want = both_outputs(block, ours, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    if moe.shared_gate:
        assert ours.shared_slots == 0 and hasattr(ours, ours.shared_name)
        return
    slots = moe.shared_intermediate_size // moe.intermediate_size
    assert ours.shared_slots == slots >= 1 and not hasattr(ours, ours.shared_name)
    assert ours.experts.w13_weight.shape[0] == moe.num_experts + slots
    assert ours.experts.w2_weight.shape[0] == moe.num_experts + slots
    ours.fuse_shared_experts()  # a second call changes nothing
    assert ours.experts.w13_weight.shape[0] == moe.num_experts + slots


def test_shared_experts_with_another_method_stay_apart() -> None:
    """fuse_shared_experts copies plain weights into the experts' stacks: a shared
    projection with another method (a quantized format's scales, here the fp32 products'
    method standing for one) or a bias is left as it is."""
    from services.executor.models.layers import SiluAndMulMLP
    from services.executor.models.linear import FP32_PRODUCTS

    block, moe = hf_block("deepseek-v2-greedy", seed=3)
    ours = load_ours(block, moe)
    mlp: SiluAndMulMLP = getattr(ours, ours.shared_name)
    mlp.down_proj.method = FP32_PRODUCTS
    ours.fuse_shared_experts()
    assert ours.shared_slots == 0 and ours.experts.w13_weight.shape[0] == moe.num_experts
    ours = load_ours(block, moe)
    gate_up = getattr(ours, ours.shared_name).gate_up_proj
    gate_up.bias = torch.nn.Parameter(torch.zeros(gate_up.out_features))
    ours.fuse_shared_experts()
    assert ours.shared_slots == 0
    ours = load_ours(block, moe)
    ours.fuse_shared_experts()
    assert ours.shared_slots >= 1  # the same layer, plain: fused
