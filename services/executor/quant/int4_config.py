"""int4 weight formats (w4a16): `quant_method: awq` (AutoAWQ's gemm packing, zero points) and
`quant_method: gptq` (AutoGPTQ's v1 and GPTQModel's gptq_v2; symmetric or not, act-order,
any group size the kernels take). int4_layouts.Int4Config checks the keys; int4_linear.py
holds and multiplies the weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

from services.executor.errors import UnsupportedQuantizationError
from services.executor.quant.base import LinearMethod, QuantConfig
from services.executor.quant.int4_layouts import Int4Config
from services.executor.quant.int4_linear import Int4Method

SUPPORTED = (
    "awq (bits 4, version gemm, zero_point true) and gptq (bits 4, checkpoint_format gptq or "
    "gptq_v2, sym or not, desc_act), group_size -1 or a power of two >= 16"
)


@dataclass(frozen=True)
class Int4QuantConfig(QuantConfig):
    family: str = "int4"
    layout: Int4Config = field(default_factory=lambda: Int4Config("awq", 128, 0, False))

    @cached_property
    def _method(self) -> LinearMethod:  # one object for every layer: it holds no layer state
        return Int4Method(self.layout)

    def method(self) -> LinearMethod:
        return self._method


def from_hf(q: dict[str, Any]) -> Int4QuantConfig:
    """`quantization_config` with quant_method awq or gptq."""
    try:
        layout = Int4Config.parse(q)
    except ValueError as e:
        raise UnsupportedQuantizationError(f"{e}; supported: {SUPPORTED}") from None
    group = "per channel" if layout.group_size < 0 else f"group {layout.group_size}"
    act_order = ", act-order" if layout.desc_act else ""
    return Int4QuantConfig(
        name=f"{layout.method} int4 ({group}{act_order})",
        family=layout.method,
        ignore=tuple(q.get("modules_to_not_convert") or ()),
        layout=layout,
    )
