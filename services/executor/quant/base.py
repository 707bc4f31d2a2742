"""The two interfaces a weight format implements: `QuantConfig` (the checkpoint's format) and
`LinearMethod` (how one projection holds and multiplies its weight), as vLLM splits them.

A `LinearMethod` creates the layer's parameters under the checkpoint's own names (`weight`,
`weight_scale`, ...), says where each checkpoint tensor goes (`slot`), and computes x @ W.T:
`dense` for any number of rows, `gemv` for the few rows of a small decode batch. One method
object serves every layer of its format: what differs per layer lives in its parameters.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import torch

from services.executor.distributed.shard import LoadPlan, Shard
from services.executor.errors import UnsupportedQuantizationError

if TYPE_CHECKING:
    from services.executor.models.linear import GemvConfig, Linear

# Writes a checkpoint tensor's part (already read) into the parameter's [start, end) (along
# the slot's `dim`) itself: for conversions at load (a float weight quantized as it is
# copied in) and for checks of what is copied.
Fill = Callable[[int, int, torch.Tensor], None]


class Slot(NamedTuple):
    """Where one checkpoint tensor goes in a parameter: its rows [start, end) (or columns,
    `dim` 1) and the part of the tensor this rank reads (the loader's Target, less the
    parameter)."""

    start: int
    end: int
    shard: Shard
    fill: Fill | None = None  # None: copied as read
    scalar: bool = False  # the tensor is one value for all these rows (a per-tensor scale)
    # the parameter's dimension that [start, end) indexes: 1 for formats that stack fused
    # parts along columns (AWQ's and GPTQ's output features are their tensors' columns)
    dim: int = 0


class LinearMethod:
    """How a Linear (models/linear.py) holds its weight and computes x @ W.T (+ bias)."""

    name = "unquantized"  # in logs, and in choose_gemv's plan keys

    def refuses(self, layer: Linear) -> str | None:
        """Why `layer` cannot take this method (it then keeps the model dtype), None if it
        can; formats that cannot fall back raise from create_weights instead."""
        return None

    def create_weights(self, layer: Linear) -> None:
        """Replace the layer's float `weight` with this format's parameters; runs on the meta
        device, before storage is allocated (so after any model-wide dtype cast)."""

    def slot(self, layer: Linear, kind: str, index: int | None, plan: LoadPlan) -> Slot | None:
        """Where the checkpoint tensor `kind` (weight, bias, weight_scale...) of stacked part
        `index` goes, given where that part's weight rows go (`plan`, in weight rows and
        columns); None: the checkpoint has no such tensor (the method computes it)."""
        return Slot(*plan)

    def finish(self, layer: Linear) -> None:
        """After every tensor is loaded: derive what the forward needs from them."""

    def init_dummy(self, layer: Linear, gen: torch.Generator) -> None:
        """Random weights for benchmarks, N(0, 0.02) before quantization."""
        layer.weight.normal_(0.0, 0.02, generator=gen)

    def dequantized(self, layer: Linear) -> torch.Tensor:
        """The weight the product uses, [out, in] in fp32 (references, the CPU path)."""
        return layer.weight.float()

    def dense(self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x @ W.T + bias for any number of rows."""
        raise NotImplementedError

    def gemv(self, layer: Linear, x: torch.Tensor, cfg: GemvConfig) -> torch.Tensor:
        """x @ W.T through the skinny decode kernel with launch configuration `cfg`."""
        raise NotImplementedError

    def gemv_candidates(self, layer: Linear) -> tuple[GemvConfig, ...]:
        """The launch configurations choose_gemv times against `dense` for `layer`. A format whose
        weights are narrower than 16 bits reads fewer bytes per column, so it wants its own
        (wider) steps: block_k counts columns, not bytes."""
        from services.executor.models.linear import CANDIDATES

        return CANDIDATES

    def dense_ahead_rows(self, layer: Linear) -> tuple[int, ...]:
        """Row counts past the gemv's, one for each specialisation of `dense`'s Triton kernels
        that the CUDA graphs' batch sizes reach, for compile_ahead to compile at start (none:
        cuBLAS, or one kernel at any count)."""
        return ()

    def apply(
        self, layer: Linear, x: torch.Tensor, bias: torch.Tensor | None = None
    ) -> torch.Tensor:
        """The skinny kernel for the row counts choose_gemv gave it, `dense` otherwise."""
        cfg = layer.gemv_plan.get(x.shape[0]) if x.dim() == 2 else None
        if cfg is None:
            return self.dense(layer, x, bias)
        out = self.gemv(layer, x, cfg)
        return out if bias is None else out + bias


def use_kernels(x: torch.Tensor) -> bool:
    """Whether products with `x` run a format's Triton kernels (CUDA), else dequantise and
    multiply in torch; tests replace it (in the method's module) to run the kernels in
    Triton's CPU interpreter."""
    return x.is_cuda


@dataclass(frozen=True)
class QuantConfig:
    """A checkpoint's weight format (or --quantization's), parsed from config.json's
    `quantization_config` by the format's module (registry.py)."""

    name: str  # as logs and errors name it, e.g. "fp8 (128x128 blocks)"
    family: str  # what --quantization calls it: "fp8"
    # checkpoint module names left in the model dtype: exact names, dotted prefixes or
    # suffixes ("lm_head", "model.layers.0"), or "re:" regular expressions
    ignore: tuple[str, ...] = ()
    online: bool = False  # the checkpoint is float; weights are quantized as they load

    def method(self) -> LinearMethod:
        """The method of every quantized projection."""
        raise NotImplementedError

    def check_device(self, device: torch.device) -> None:
        """Raise UnsupportedQuantizationError when `device` cannot run this format."""

    def method_for(self, names: list[str]) -> LinearMethod | None:
        """The method of a projection filled by the checkpoint modules `names` (several for
        a fused one: q/k/v); None where the checkpoint left them unquantized."""
        skipped = [is_ignored(n, self.ignore) for n in names]
        if all(skipped):
            return None
        if any(skipped):
            raise UnsupportedQuantizationError(
                f"{self.name}: {', '.join(names)} are fused into one projection, but the "
                "checkpoint quantizes only some of them"
            )
        return self.method()


def is_ignored(name: str, patterns: tuple[str, ...]) -> bool:
    """Whether checkpoint module `name` matches an ignore entry (see QuantConfig.ignore)."""
    for p in patterns:
        if p.startswith("re:"):
            if re.match(p[3:], name):
                return True
        elif name == p or name.startswith(p + ".") or name.endswith("." + p):
            return True
    return False
