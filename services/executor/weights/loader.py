"""Building a model without allocating weights twice, then filling it from a tensor stream.

The model is built on the meta device (no memory), given uninitialised storage once in the
target dtype and device, and each checkpoint tensor is copied into place as it is read, so
peak memory is the model plus one tensor. Under tensor parallelism each rank reads only its
part of each tensor (a safetensors slice is read from the file without the rest), so no rank
holds the whole model in host memory.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator
from typing import NamedTuple, Protocol

import torch

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.distributed.shard import WHOLE, Shard
from services.executor.errors import ModelLoadError
from services.executor.model_config import ModelConfig
from services.executor.models import get_model_class
from services.executor.models.linear import UNQUANTIZED, Linear
from services.executor.models.llama import STACKED, LlamaForCausalLM
from services.executor.quant.apply import quantize_model
from services.executor.quant.base import Fill, QuantConfig, Slot


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


class RowSlice:
    """Rows [start, start + rows) of a checkpoint tensor that stacks several of the model's
    (Phi-3's qkv_proj): a tensor of its own, read (in part) from the whole one."""

    def __init__(self, whole: TensorSource, start: int, rows: int) -> None:
        self.whole, self.start, self.rows = whole, start, rows

    @property
    def shape(self) -> tuple[int, ...]:
        return (self.rows, *self.whole.shape[1:])

    def read(self, index: tuple[slice, ...]) -> torch.Tensor:
        first = index[0] if index else slice(None)
        assert first.step is None, "checkpoint reads are contiguous"
        lo = self.start + (first.start or 0)
        hi = self.start + (self.rows if first.stop is None else first.stop)
        return self.whole.read((slice(lo, hi), *index[1:]))


class Target(NamedTuple):
    param: torch.Tensor
    start: int  # the parameter's rows [start, end) this checkpoint tensor fills
    end: int
    shard: Shard  # the part of the checkpoint tensor that goes there
    fill: Fill | None = None  # None: copied as read; else writes the part itself (quant/)
    scalar: bool = False  # one value for all the rows (a per-tensor scale)
    dim: int = 0  # [start, end) are along this dimension of param (1: columns)

    def dest(self) -> torch.Tensor:
        """The part of the parameter this checkpoint tensor fills."""
        return self.param.narrow(self.dim, self.start, self.end - self.start)


# Checkpoint entries that are not weights (old HF checkpoints saved the RoPE table).
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def build_empty_model(
    config: ModelConfig,
    device: torch.device,
    dtype: torch.dtype,
    backend: AttentionBackend,
    tp: TPGroup = SINGLE,
    quant: QuantConfig | None = None,
) -> LlamaForCausalLM:
    """The model for `config` (this rank's shard of it) with uninitialised weights on
    `device`, in eval mode; its projections in `quant`'s format (None: `dtype`)."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config, backend, tp)
    model.to(dtype=dtype)  # free on meta
    if quant is not None:  # after the cast, which would turn fp8 weights into `dtype`
        quantize_model(model, quant)
    model.to_empty(device=device)
    model.tie_weights()
    model.eval().requires_grad_(False)
    return model


def checkpoint_layout(model: LlamaForCausalLM) -> dict[str, Target]:
    """Every checkpoint (HF) tensor name -> the parameter rows it fills and the part of it
    this rank reads.

    Fused projections (qkv_proj, gate_up_proj) are filled by several checkpoint tensors,
    stacked along rows in the order of `STACKED`; stacked experts ([experts, ...] parameters)
    list the per-expert tensors that fill them (`checkpoint_parts`, models/moe.py);
    everything else maps one to one. Sharded modules say what their rank reads (`load_plan`,
    distributed/layers.py).
    """
    layout: dict[str, Target] = {}
    fused_into: dict[str, list[tuple[int, str]]] = {}
    for ckpt_module, (fused, index) in STACKED.items():
        fused_into.setdefault(fused, []).append((index, ckpt_module))
    for name, param in model.named_parameters():  # a tied lm_head appears once
        *prefix, module_name, kind = name.split(".")
        module = model.get_submodule(".".join([*prefix, module_name]))
        plan = getattr(module, "load_plan", None)
        parts = getattr(module, "checkpoint_parts", None)
        if parts is not None:
            for suffix, view, start, end, shard, fill in parts(kind):
                target = Target(view, start, end, shard, fill)
                layout[".".join([*prefix, module_name, suffix])] = target
            continue
        # (stacked part index, the checkpoint tensor's name)
        sources: list[tuple[int | None, str]] = [(None, name)]
        if module_name in fused_into:
            assert plan is not None, f"{name}: a fused projection says how it is filled"
            sources = [
                (index, ".".join([*prefix, ckpt_module, kind]))
                for index, ckpt_module in sorted(fused_into[module_name])
            ]
        method = getattr(module, "method", None)  # a Linear's weight format
        for part, ckpt_name in sources:
            rows = plan(kind, part) if plan else (0, param.shape[0], WHOLE)
            slot = method.slot(module, kind, part, rows) if method else Slot(*rows)
            if slot is not None:  # None: computed at load, not in the checkpoint
                layout[ckpt_name] = Target(param, *slot)
    return layout


def block_weights(model: LlamaForCausalLM) -> set[str]:
    """Checkpoint names of the weights the model keeps as GGUF blocks (uint8 parameters)."""
    out = set()
    for name, target in checkpoint_layout(model).items():
        if target.param.dtype == torch.uint8:
            for theirs, ours in model.checkpoint_renames:
                name = name.replace(ours, theirs)
            out.add(name)
    return out


def hf_state_dict(model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """The model's weights under checkpoint names and shapes (views, no copies); a model of
    one rank only: a shard is not the checkpoint's tensor."""
    assert model.tp.size == 1, "hf_state_dict of a tensor-parallel shard"
    layout = checkpoint_layout(model)
    out = {name: t.dest() for name, t in layout.items()}
    # A checkpoint that stacks modules (Phi-3's qkv_proj) stacks them as our fused ones do.
    for fused, parts in model.checkpoint_splits().items():
        for name in [n for n in layout if n.split(".")[-2] == parts[0][0]]:
            *prefix, _, kind = name.split(".")
            names = [".".join([*prefix, part, kind]) for part, _ in parts]
            first, last = layout[names[0]], layout[names[-1]]
            for n in names:
                del out[n]
            out[".".join([*prefix, fused, kind])] = first.param[first.start : last.end]
    renamed = {}
    for name, tensor in out.items():
        for theirs, ours in model.checkpoint_renames:  # back to the checkpoint's own names
            name = name.replace(ours, theirs)
        renamed[name] = tensor
    return renamed


def split_fused(
    model: LlamaForCausalLM,
    weights: Iterable[tuple[str, TensorSource | torch.Tensor]],
    source: str,
) -> Iterator[tuple[str, TensorSource | torch.Tensor]]:
    """The checkpoint's tensors, each one that stacks several of the model's modules
    (`model.checkpoint_splits()`) yielded as its parts, row slices read only when asked for:
    under tensor parallelism each rank then reads its own q/k/v heads and gate/up rows."""
    splits = model.checkpoint_splits()
    for name, raw in weights:
        *prefix, module, kind = name.split(".")
        parts = splits.get(module)
        if parts is None:
            yield name, raw
            continue
        whole = InMemory(raw) if isinstance(raw, torch.Tensor) else raw
        rows = sum(n for _, n in parts)
        if whole.shape[0] != rows:
            raise ModelLoadError(
                f"{source}: weight {name} has shape {whole.shape}; the config implies {rows} rows "
                f"({' + '.join(f'{part} {n}' for part, n in parts)})"
            )
        start = 0
        for part, n in parts:
            yield ".".join([*prefix, part, kind]), RowSlice(whole, start, n)
            start += n


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
    renames = model.checkpoint_renames
    for name, raw in split_fused(model, _split_stacked_experts(weights), source):
        for theirs, ours in renames:
            name = name.replace(theirs, ours)
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
    missing = _fused_names(model, sorted(set(layout) - loaded))
    if missing or unexpected:
        raise ModelLoadError(
            f"{source}: weights do not match the {model.config.architecture} config; "
            f"missing: {_names(missing)}; unexpected: {_names(unexpected)}"
        )


# transformers 5's in-memory MoE layout, which a checkpoint may hold instead of HF's
# per-expert tensors: experts.gate_up_proj [E, 2I, H] (gate rows first), down_proj [E, H, I].
_STACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def _split_stacked_experts(
    weights: Iterable[tuple[str, TensorSource | torch.Tensor]],
) -> Iterator[tuple[str, TensorSource | torch.Tensor]]:
    """The weights, with stacked expert tensors given as the per-expert ones (views of the
    tensor read whole) that the layout names."""
    for name, raw in weights:
        if not name.endswith(_STACKED_EXPERTS):
            yield name, raw
            continue
        t = raw if isinstance(raw, torch.Tensor) else raw.read(())
        prefix = name.rsplit(".", 1)[0]  # ....experts
        if name.endswith("gate_up_proj"):
            inter = t.shape[1] // 2
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.gate_proj.weight", t[e, :inter]
                yield f"{prefix}.{e}.up_proj.weight", t[e, inter:]
        else:
            for e in range(t.shape[0]):
                yield f"{prefix}.{e}.down_proj.weight", t[e]


def _copy(target: Target, tensor: TensorSource, name: str, source: str) -> None:
    shard = target.shard
    shape = tensor.shape
    if target.scalar:
        if math.prod(shape) != 1:
            raise ModelLoadError(
                f"{source}: weight {name} has shape {shape}, a per-tensor scale (one value)"
            )
        _write(target, tensor.read(()).reshape(()), name, source)
        return
    dest = tuple(target.dest().shape)
    expected = dest
    if shard.dim is not None:  # the whole tensor's: the part read would hide a mis-shaped one
        expected = tuple(shard.full if d == shard.dim else n for d, n in enumerate(dest))
    if shape != expected:
        raise ModelLoadError(
            f"{source}: weight {name} has shape {shape}, the config implies {expected}"
        )
    _write(target, tensor.read(shard.index(len(shape))), name, source)


def _write(target: Target, part: torch.Tensor, name: str, source: str) -> None:
    if target.fill is not None:
        try:
            target.fill(target.start, target.end, part)
        except ModelLoadError as e:  # the format refused the tensor: say which one
            raise ModelLoadError(f"{source}: weight {name} {e}") from None
    else:  # a scalar broadcasts over the rows
        target.dest().copy_(part)


def init_dummy_weights(model: LlamaForCausalLM, seed: int = 0) -> None:
    """Random weights for benchmarks: N(0, 0.02) everywhere (quantized projections: that,
    quantized in their format), norms the identity (weights 1, or 0 where a model's norms
    scale by 1 + w: `norm_offset`)."""
    device = next(model.parameters()).device
    gen = torch.Generator(device=device).manual_seed(seed)
    norm_weight = 1.0 - getattr(model, "norm_offset", 0.0)
    done: set[int] = set()  # parameters a quantized format filled
    for layer in model.modules():
        if isinstance(layer, Linear) and layer.method is not UNQUANTIZED:
            layer.method.init_dummy(layer, gen)
            done.update(id(p) for n, p in layer.named_parameters() if n != "bias")
        elif not isinstance(layer, Linear) and callable(init := getattr(layer, "init_dummy", None)):
            done.update(init(gen))  # fp8 experts (models/moe.py)
    for name, param in model.named_parameters():
        if id(param) in done:
            continue
        if name.endswith("norm.weight"):
            param.fill_(norm_weight)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def finish_loading(model: LlamaForCausalLM) -> None:
    """What each projection's format derives from its loaded tensors (quant/base.py), then
    each module's own `after_loading` (models/deepseek.py fuses two projections)."""
    modules = list(model.modules())
    for layer in modules:
        if isinstance(layer, Linear):
            layer.method.finish(layer)
    for module in modules:
        after = getattr(module, "after_loading", None)
        if after is not None:
            after()


def _fused_names(model: LlamaForCausalLM, names: list[str]) -> list[str]:
    """Missing weights as the checkpoint names them: a stacked part as its fused tensor."""
    splits = model.checkpoint_splits()
    part_of = {part: fused for fused, parts in splits.items() for part, _ in parts}
    out: list[str] = []
    for name in names:
        *prefix, module, kind = name.split(".")
        if module in part_of:
            name = ".".join([*prefix, part_of[module], kind])
        if name not in out:
            out.append(name)
    return out


def _names(names: list[str], limit: int = 10) -> str:
    if not names:
        return "none"
    more = f" (+{len(names) - limit} more)" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more
