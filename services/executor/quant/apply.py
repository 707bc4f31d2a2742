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
    model.quantization = quant


def _checkpoint_name(model: LlamaForCausalLM, name: str) -> str:
    for theirs, ours in model.checkpoint_renames:
        name = name.replace(ours, theirs)
    return name


def _check_model(model: LlamaForCausalLM, quant: QuantConfig) -> None:
    config = model.config
    what = ""
    if config.moe is not None:
        what = "routed experts (MoE)"
    elif config.mla is not None:
        what = "latent attention (MLA), whose kv_b_proj is read as a matrix"
    elif model.checkpoint_splits() and not quant.online:
        what = "a checkpoint that stacks its projections (scales per stacked tensor)"
    if what:
        raise UnsupportedQuantizationError(
            f"{quant.name} weights for {config.architecture}: {what} are not supported; "
            "quantized weights run on dense models (Llama, Mistral, Qwen2, Qwen3, Gemma"
            + (", Phi-3 with --quantization fp8" if quant.online else "")
            + ")"
        )
