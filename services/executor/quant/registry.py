"""Every weight format radixserve reads, in one table: a checkpoint's `quant_method` ->
the module that parses its `quantization_config` (`from_hf(config) -> QuantConfig`),
imported only when a checkpoint names it. Adding a format is one module and one line here.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, NamedTuple

from services.executor.errors import UnsupportedQuantizationError

if TYPE_CHECKING:  # torch: `radixserve serve` reads QUANTIZATION_CHOICES for its flags
    from services.executor.quant.base import QuantConfig


class Format(NamedTuple):
    module: str
    covers: str  # what of it is supported, for the error that lists the formats


FORMATS: dict[str, Format] = {
    "fp8": Format("services.executor.quant.fp8_config", "fp8 per tensor or 128x128 blocks"),
    "compressed-tensors": Format(
        "services.executor.quant.compressed_tensors", "fp8 per tensor, channel or block"
    ),
    "gguf": Format("services.executor.quant.gguf_config", "one GGUF block type, dummy weights"),
    "awq": Format("services.executor.quant.int4_config", "int4, gemm packing, zero points"),
    "gptq": Format("services.executor.quant.int4_config", "int4, v1 or v2, act-order"),
}
# --quantization NAME: a float checkpoint quantized at load (`online() -> QuantConfig`)
ONLINE: dict[str, str] = {
    "fp8": "services.executor.quant.fp8_config",
}
QUANTIZATION_CHOICES = ("auto", *ONLINE)


def from_hf_config(q: dict[str, Any] | None, source: str) -> QuantConfig | None:
    """config.json's `quantization_config` (None: a float checkpoint) as a QuantConfig;
    UnsupportedQuantizationError naming any format not in FORMATS."""
    if q is None:
        return None
    method = str(q.get("quant_method", "")).lower()
    if method not in FORMATS:
        raise UnsupportedQuantizationError(
            f"{source}: quantization_config's quant_method {method or '(none)'!r} is not "
            f"supported; supported: {', '.join(f'{k} ({f.covers})' for k, f in FORMATS.items())}"
            f", or a float checkpoint with --quantization {' or '.join(ONLINE)}"
        )
    try:
        config: QuantConfig = importlib.import_module(FORMATS[method].module).from_hf(q)
    except UnsupportedQuantizationError as e:
        raise UnsupportedQuantizationError(f"{source}: {e}") from None
    return config


def resolve(flag: str, checkpoint: QuantConfig | None) -> QuantConfig | None:
    """The format to load with: --quantization `flag` ("auto": the checkpoint's own) against
    the checkpoint's format (None: float weights)."""
    if flag not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"--quantization={flag!r}: unknown; choose one of {', '.join(QUANTIZATION_CHOICES)}"
        )
    if flag == "auto" or (checkpoint is not None and checkpoint.family == flag):
        return checkpoint
    if checkpoint is not None:
        raise UnsupportedQuantizationError(
            f"--quantization {flag}: the checkpoint is already quantized ({checkpoint.name}); "
            "leave --quantization at auto"
        )
    online: QuantConfig = importlib.import_module(ONLINE[flag]).online()
    return online
