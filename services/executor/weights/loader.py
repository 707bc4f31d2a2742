"""Building a model without allocating weights twice, then filling it from a tensor stream.

The model is built on the meta device (no memory), given uninitialised storage once in the
target dtype and device, and each checkpoint tensor is copied into place as it is read, so
peak memory is the model plus one tensor.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from services.executor.attention import AttentionBackend
from services.executor.errors import ModelLoadError
from services.executor.model_config import ModelConfig
from services.executor.models import get_model_class
from services.executor.models.llama import LlamaForCausalLM

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


def load_weights(
    model: LlamaForCausalLM, weights: Iterable[tuple[str, torch.Tensor]], source: str
) -> None:
    """Copy every (HF name, tensor) into `model`; every parameter must be set exactly once.

    A tied lm_head.weight in the checkpoint is skipped. Raises ModelLoadError naming missing,
    unexpected or mis-shaped weights.
    """
    params = dict(model.named_parameters())  # a tied lm_head appears once, as embed_tokens
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, tensor in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        param = params.get(name)
        if param is None:
            unexpected.append(name)
            continue
        if tensor.shape != param.shape:
            raise ModelLoadError(
                f"{source}: weight {name} has shape {tuple(tensor.shape)}, "
                f"the config implies {tuple(param.shape)}"
            )
        param.copy_(tensor)
        loaded.add(name)
    missing = sorted(set(params) - loaded)
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
