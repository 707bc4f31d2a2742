"""Giving a built model's projections their weight format.

The model classes build every projection as a float Linear and know nothing of formats; this
pass, run on the meta device before storage is allocated, asks the format for each Linear's
method by the checkpoint names that fill it (a fused qkv_proj is q_proj, k_proj and v_proj),
so ignore lists written against checkpoint names apply as written.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from services.executor.errors import UnsupportedQuantizationError
from services.executor.models.linear import Linear
from services.executor.quant.base import QuantConfig

if TYPE_CHECKING:
    from services.executor.models.llama import LlamaForCausalLM

log = logging.getLogger(__name__)


def quantize_model(model: LlamaForCausalLM, quant: QuantConfig) -> None:
    """Give every quantizable Linear its method from `quant` and let it create its
    parameters; UnsupportedQuantizationError for models the formats do not cover yet."""
    from services.executor.models.llama import STACKED

    _check_model(model, quant)
    fused: dict[str, list[str]] = {}
    for part, (into, _) in sorted(STACKED.items(), key=lambda kv: kv[1]):
        fused.setdefault(into, []).append(part)
    for name, layer in model.named_modules():
        if not isinstance(layer, Linear) or not layer.quantizable:
            continue
        *prefix, leaf = name.split(".")
        names = [".".join([*prefix, part]) for part in fused.get(leaf, [leaf])]
        method = quant.method_for([_checkpoint_name(model, n) for n in names])
        why = method.refuses(layer) if method is not None else None
        if why:
            log.warning("%s stays in the model dtype (%s): %s", name, quant.name, why)
        elif method is not None:
            method.create_weights(layer)
            layer.method = method
    _quantize_experts(model, quant)
    model.quantization = quant


def _quantize_experts(model: LlamaForCausalLM, quant: QuantConfig) -> None:
    """Routed experts of an fp8 model take their fp8 form (models/fp8_experts.py): block
    scales, or a scale per row from the checkpoint or computed as they load
    (--quantization fp8); those the format leaves out (an ignore list) stay in the model
    dtype."""
    from services.executor.models.moe import FusedExperts
    from services.executor.quant.fp8_linear import Fp8BlockMethod, Fp8ChannelMethod

    for name, module in model.named_modules():
        if not isinstance(module, FusedExperts):
            continue
        # the checkpoint's names (renames match whole components: Mixtral's `.w1.`)
        parts = ("gate_proj", "up_proj", "down_proj")
        names = [_checkpoint_name(model, f"{name}.0.{p}.weight")[: -len(".weight")] for p in parts]
        method = quant.method_for(names)
        if isinstance(method, Fp8BlockMethod):
            module.use_fp8("block", method.scale_name)
        elif isinstance(method, Fp8ChannelMethod) and method.source in ("channel", "online"):
            module.use_fp8("channel", "weight_scale", online=method.source == "online")
        elif method is not None:
            raise UnsupportedQuantizationError(
                f"{quant.name} weights of routed experts (MoE) in {name}: not supported; "
                f"quantized experts: {EXPERT_FORMATS}"
            )


def _checkpoint_name(model: LlamaForCausalLM, name: str) -> str:
    for theirs, ours in model.checkpoint_renames:
        name = name.replace(ours, theirs)
    return name


def _check_model(model: LlamaForCausalLM, quant: QuantConfig) -> None:
    config = model.config
    what = ""
    if config.mla is not None and not _fp8_experts(quant):
        what = "latent attention (MLA), whose kv_b_proj is read as a matrix"
    elif config.moe is not None and not _fp8_experts(quant):
        what = "routed experts (MoE)"
    elif model.checkpoint_splits() and not quant.online:
        what = "a checkpoint that stacks its projections (scales per stacked tensor)"
    if what:
        raise UnsupportedQuantizationError(
            f"{quant.name} weights for {config.architecture}: {what} are not supported; "
            "quantized weights run on dense models (Llama, Mistral, Qwen2, Qwen3, Gemma"
            + (", Phi-3 with --quantization fp8" if quant.online else "")
            + f"); on mixture-of-experts and latent-attention ones (Qwen2-MoE, Qwen3-MoE, "
            f"Mixtral, DeepSeek-V2/V3): {EXPERT_FORMATS}"
        )


EXPERT_FORMATS = (
    "fp8 with 128x128 block scales or a scale per channel (dynamic activations), and "
    "--quantization fp8"
)


def _fp8_experts(quant: QuantConfig) -> bool:
    """An fp8 format the experts and latent attention take: 128x128 block scales
    (DeepSeek's and Qwen's FP8 releases), a scale per channel with dynamic activations
    (compressed-tensors'), or --quantization fp8 (per channel, at load)."""
    scheme = getattr(quant, "scheme", None)
    return scheme in ("block", "channel") and not getattr(quant, "static_input", False)
