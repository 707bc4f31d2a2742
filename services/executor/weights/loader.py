"""Building a model without allocating weights twice, then filling it from a tensor stream.

The model is built on the meta device (no memory), given uninitialised storage once in the
target dtype and device, and each checkpoint tensor is copied into place as it is read, so
peak memory is the model plus one tensor. Under tensor parallelism each rank reads only its
part of each tensor (a safetensors slice is read from the file without the rest), so no rank
holds the whole model in host memory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import NamedTuple, Protocol

import torch

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.layers import WHOLE, Shard
from services.executor.errors import ModelLoadError
from services.executor.model_config import ModelConfig
from services.executor.models import get_model_class
from services.executor.models.llama import STACKED, LlamaForCausalLM


class TensorSource(Protocol):
    """A checkpoint tensor not read yet: its shape, and a read of any part of it."""

    @property
    def shape(self) -> tuple[int, ...]: ...

    def read(self, index: tuple[slice, ...]) -> torch.Tensor: ...


class InMemory:
    """A tensor already read (GGUF's dequantised ones, a .bin's mmap'd ones)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape)

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        return self.tensor[index]


class Target(NamedTuple):
    param: torch.Tensor
    start: int  # the parameter's rows [start, end) this checkpoint tensor fills
    end: int
    shard: Shard  # the part of the checkpoint tensor that goes there


# Checkpoint entries that are not weights (old HF checkpoints saved the RoPE table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_empty_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    tp: TPGroup = SINGLE,
) -> LlamaForCausalLM:
    """The model for `config` (this rank's shard of it) with uninitialised weights on
    `device`, in eval mode."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, backend, tp)
    model.to(dtype=dtype)  # free on meta
    model.to_empty(device=device)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return model


def checkpoint_layout(model: LlamaForCausalLM) -> dict[str, Target]:
    """Every checkpoint (HF) tensor name -> the parameter rows it fills and the part of it
    this rank reads.

    Fused projections (qkv_proj, gate_up_proj) are filled by several checkpoint tensors,
    stacked along rows in the order of `STACKED`; everything else maps one to one. Sharded
    modules say what their rank reads (`load_plan`, distributed/layers.py).
    """
    layout: dict[str, Target] = {}
    fused_into: dict[str, list[tuple[int, str]]] = {}
    for ckpt_module, (fused, index) in STACKED.items():
        fused_into.setdefault(fused, []).append((index, ckpt_module))
    for name, param in model.named_parameters():  # a tied lm_head appears once
        *prefix, module_name, kind = name.split(".")
        module = model.get_submodule(".".join([*prefix, module_name]))
        plan = getattr(module, "load_plan", None)
        if module_name not in fused_into:
            start, end, shard = plan(kind, None) if plan else (0, param.shape[0], WHOLE)
            layout[name] = Target(param, start, end, shard)
            continue
        assert plan is not None, f"{name}: a fused projection says how it is filled"
        for index, ckpt_module in sorted(fused_into[module_name]):
            layout[".".join([*prefix, ckpt_module, kind])] = Target(param, *plan(kind, index))
    return layout


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names and shapes (views, no copies); a model of
    one rank only: a shard is not the checkpoint's tensor."""
    assert model.tp.size == 1, "hf_state_dict of a tensor-parallel shard"
    return {name: t.param[t.start : t.end] for name, t in checkpoint_layout(model).items()}


def load_weights(
    model: LlamaForCausalLM,
    weights: Iterable[tuple[str, TensorSource | torch.Tensor]],
    source: str,
    progress: Callable[[float], None] | None = None,
) -> None:
    """Copy every (HF name, tensor) into `model` (this rank's part of it); every checkpoint
    tensor the config implies must come exactly once.

    A tied lm_head.weight in the checkpoint is skipped. Raises ModelLoadError naming missing,
    unexpected or mis-shaped weights. `progress` hears the share loaded so far.
    """
    layout = checkpoint_layout(model)
    tied = model.config.tie_word_embeddings
    loaded: set[str] = set()
    unexpected: list[str] = []
    for name, raw in weights:
        if name.endswith(_IGNORED_SUFFIXES) or (tied and name == "lm_head.weight"):
            continue
        target = layout.get(name)
        if target is None:
            unexpected.append(name)
            continue
        tensor_source = InMemory(raw) if isinstance(raw, torch.Tensor) else raw
        _copy(target, tensor_source, name, source)
        loaded.add(name)
        if progress is not None:
            progress(len(loaded) / len(layout))
    missing = sorted(set(layout) - loaded)
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match the {model.config.architecture} config; "
            f"missing: {_names(missing)}; unexpected: {_names(unexpected)}"
        )


def _copy(target: Target, tensor: TensorSource, name: str, source: str) -> None:
    param, shard = target.param, target.shard
    shape = tensor.shape
    if shard.dim is None:
        expected = (target.end - target.start, *param.shape[1:])
    else:  # the whole tensor's shape: the part read would hide a mis-shaped checkpoint
        dest = (target.end - target.start, *param.shape[1:])
        expected = tuple(shard.full if d == shard.dim else n for d, n in enumerate(dest))
    if shape != expected:
        raise ModelLoadError(
            f"{source}: weight {name} has shape {shape}, the config implies {expected}"
        )
    param[target.start : target.end].copy_(tensor.read(shard.index(len(shape))))


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) everywhere, norms the identity (weights 1,
    or 0 where a model's norms scale by 1 + w: `norm_offset`)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weight = 1.0 - getattr(model, "norm_offset", 0.0)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(norm_weight)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def _names(names: list[str], limit: int = 10) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
