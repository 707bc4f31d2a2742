"""FP8 weight formats: which scales a checkpoint holds, and `quant_method: fp8` configs.

`quant_method: fp8` is what DeepSeek-V3 and Qwen3-FP8 publish (`weight_block_size: [128,
128]`, `weight_scale_inv`, dynamic activations) and what AutoFP8 wrote before
compressed-tensors (one `weight_scale` per tensor, `input_scale` when activation_scheme is
static). compressed-tensors' fp8 configs are read by compressed_tensors.py into the same
`Fp8Config`; --quantization fp8 on a float checkpoint is `online()`.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from services.executor.errors import UnsupportedQuantizationError
from services.executor.quant.base import LinearMethod, QuantConfig
from services.executor.quant.fp8_linear import Fp8BlockMethod, Fp8ChannelMethod

SCHEMES = ("tensor", "channel", "block")
_BLOCK = [128, 128]


@dataclass(frozen=True)
class Fp8Config(QuantConfig):
    family: str = "fp8"
    scheme: str = "channel"  # a scale per tensor, per output row, or per 128x128 block
    static_input: bool = False  # the checkpoint's input_scale quantizes activations
    scale_name: str = "weight_scale"  # the block scales' checkpoint name

    def __post_init__(self) -> None:
        assert self.scheme in SCHEMES, self.scheme
        if self.static_input and self.scheme == "block":
            raise UnsupportedQuantizationError(
                f"{self.name}: static activation scales with 128x128 block weights are not "
                "supported; supported: dynamic activations (activation_scheme: dynamic)"
            )

    @cached_property
    def _method(self) -> LinearMethod:  # one object for every layer: it holds no layer state
        if self.scheme == "block":
            return Fp8BlockMethod(self.scale_name)
        source = "online" if self.online else self.scheme
        return Fp8ChannelMethod(source, self.static_input)

    def method(self) -> LinearMethod:
        return self._method

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            return
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise UnsupportedQuantizationError(
                f"{self.name}: fp8 weights need a GPU of compute capability 8.9 or newer (Ada, "
                f"Hopper); {torch.cuda.get_device_name(device)} is {major}.{minor}"
            )


def online() -> Fp8Config:
    """--quantization fp8 on a float checkpoint: per-channel scales computed at load."""
    return Fp8Config(name="fp8 (per channel, quantized at load)", online=True)


def from_hf(q: dict[str, Any]) -> Fp8Config:
    """`quantization_config` with quant_method fp8."""
    fmt = q.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedQuantizationError(
            f"fp8 checkpoint in format {fmt!r}: supported: e4m3 (float8_e4m3fn)"
        )
    ignore = tuple(q.get("ignored_layers") or q.get("modules_to_not_convert") or ())
    activations = q.get("activation_scheme", "dynamic")
    if activations not in ("dynamic", "static"):
        raise UnsupportedQuantizationError(
            f"fp8 checkpoint with activation_scheme {activations!r}: supported: dynamic, static"
        )
    block = q.get("weight_block_size")
    if block is None:
        return Fp8Config(
            name="fp8 (per tensor)",
            scheme="tensor",
            static_input=activations == "static",
            ignore=ignore,
        )
    if list(block) != _BLOCK:
        raise UnsupportedQuantizationError(
            f"fp8 checkpoint with weight_block_size {block}: supported: {_BLOCK}"
        )
    return Fp8Config(
        name="fp8 (128x128 blocks)",
        scheme="block",
        static_input=activations == "static",
        ignore=ignore,
        scale_name="weight_scale_inv",
    )
