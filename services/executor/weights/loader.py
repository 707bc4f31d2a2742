"""Building a model without allocating weights twice, then filling it from a tensor stream.

The model is built on the meta device (no memory), given uninitialised storage once in the
target dtype and device, and each checkpoint tensor is copied into place as it is read, so
peak memory is the model plus one tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from services.executor.attention import AttentionBackend
from services.executor.errors import ModelLoadError
from services.executor.model_config import ModelConfig
from services.executor.models import get_model_class
from services.executor.models.llama import STACKED, LlamaForCausalLM, shard_rows

# Checkpoint entries that are not weights (old HF checkpoints saved the RoPE table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_empty_model(
    config: ModelConfig, device: torch.device, dtype: torch.dtype, backend: AttentionBackend
) -> LlamaForCausalLM:
    """The model for `config` with uninitialised weights on `device`, in eval mode."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, backend)
    model.to(dtype=dtype)  # free on meta
    model.to_empty(device=device)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return model


def checkpoint_layout(model: LlamaForCausalLM) -> dict[str, tuple[torch.Tensor, int, int]]:
    """Every checkpoint (HF) tensor name -> (our parameter, first row, end row) it fills.

    Fused projections (qkv_proj, gate_up_proj) are filled by several checkpoint tensors,
    stacked along rows in the order of `STACKED`; everything else maps one to one.
    """
    layout: dict[str, tuple[torch.Tensor, int, int]] = {}
    fused_into: dict[str, list[tuple[int, str]]] = {}
    for ckpt_module, (fused, index) in STACKED.items():
        fused_into.setdefault(fused, []).append((index, ckpt_module))
    for name, param in model.named_parameters():  # a tied lm_head appears once
        *prefix, module, kind = name.split(".")
        if module not in fused_into:
            layout[name] = (param, 0, param.shape[0])
            continue
        rows = shard_rows(model.config, module)
        start = 0
        for index, ckpt_module in sorted(fused_into[module]):
            layout[".".join([*prefix, ckpt_module, kind])] = (param, start, start + rows[index])
            start += rows[index]
    return layout


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names and shapes (views, no copies)."""
    return {name: p[a:b] for name, (p, a, b) in checkpoint_layout(model).items()}


def load_weights(
    model: LlamaForCausalLM,
    weights: Iterable[tuple[str, torch.Tensor]],
    source: str,
    progress: Callable[[float], None] | None = None,
) -> None:
    """Copy every (HF name, tensor) into `model`; every checkpoint tensor the config implies
    must come exactly once.

    A tied lm_head.weight in the checkpoint is skipped. Raises ModelLoadError naming missing,
    unexpected or mis-shaped weights. `progress` hears the share loaded so far.
    """
    layout = checkpoint_layout(model)
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target = layout.get(name)
        if target is None:
            unexpected.append(name)
            continue
        param, a, b = target
        expected = (b - a, *param.shape[1:])
        if tuple(tensor.shape) != expected:
            raise ModelLoadError(
                f"{source}: weight {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {expected}"
            )
        param[a:b].copy_(tensor)
        loaded.add(name)
        if progress is not None:
            progress(len(loaded) / len(layout))
    missing = sorted(set(layout) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match the {model.config.architecture} config; "
            f"missing: {_names(missing)}; unexpected: {_names(unexpected)}"
        )


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) everywhere, norm weights 1."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _names(names: list[str], limit: int = 10) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
