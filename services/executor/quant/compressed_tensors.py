"""compressed-tensors (llm-compressor, Neural Magic / Red Hat) `quantization_config`s: the fp8
ones, read into an `Fp8Config`; every other scheme refused by name.

    {"quant_method": "compressed-tensors", "format": "float-quantized",
     "config_groups": {"group_0": {"targets": ["Linear"],
        "weights": {"type": "float", "num_bits": 8, "strategy": "channel", ...},
        "input_activations": {"type": "float", "num_bits": 8, "strategy": "token",
                              "dynamic": true}}},
     "ignore": ["lm_head"]}

Weights: strategy tensor (weight_scale [1]), channel ([N, 1]) or block (block_structure
[128, 128], weight_scale [ceil(N/128), ceil(K/128)]). Activations: none (weight-only: the
GEMMs quantize them per token anyway), dynamic per token, or static per tensor
(input_scale).
"""

from __future__ import annotations

from typing import Any

from services.executor.errors import UnsupportedQuantizationError
from services.executor.quant.fp8_config import Fp8Config

_FP8_FORMATS = ("float-quantized", "naive-quantized")


def from_hf(q: dict[str, Any]) -> Fp8Config:
    fmt = q.get("format")
    groups = list((q.get("config_groups") or {}).values())
    if fmt not in _FP8_FORMATS or not groups:
        raise _refuse(f"format {fmt!r}")
    if q.get("kv_cache_scheme"):
        raise _refuse("kv_cache_scheme (calibrated KV scales); use --kv-cache-dtype instead")
    schemes = {_scheme(g) for g in groups}
    if len(schemes) != 1:
        raise _refuse(f"{len(schemes)} different schemes in config_groups")
    scheme, static = schemes.pop()
    label = {"tensor": "per tensor", "channel": "per channel", "block": "128x128 blocks"}
    return Fp8Config(
        name=f"compressed-tensors fp8 ({label[scheme]})",
        scheme=scheme,
        static_input=static,
        ignore=tuple(q.get("ignore") or ()),
    )


def _scheme(group: dict[str, Any]) -> tuple[str, bool]:
    """(weight strategy, static activation scales) of one config group, fp8 or refused."""
    w = group.get("weights") or {}
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(f"weights of type {w.get('type')!r} with {w.get('num_bits')} bits")
    strategy = w.get("strategy")
    if strategy == "block" and list(w.get("block_structure") or []) != [128, 128]:
        raise _refuse(f"weight blocks of {w.get('block_structure')}")
    if strategy not in ("tensor", "channel", "block") or w.get("dynamic"):
        raise _refuse(f"weight strategy {strategy!r}" + (" (dynamic)" if w.get("dynamic") else ""))
    act = group.get("input_activations")
    if not act:
        return strategy, False
    if act.get("type") != "float" or act.get("num_bits") != 8:
        raise _refuse(f"activations of type {act.get('type')!r} with {act.get('num_bits')} bits")
    dynamic = bool(act.get("dynamic"))
    if (dynamic and act.get("strategy") != "token") or (
        not dynamic and act.get("strategy") != "tensor"
    ):
        raise _refuse(f"{'dynamic' if dynamic else 'static'} activations per {act.get('strategy')}")
    return strategy, not dynamic


def _refuse(what: str) -> UnsupportedQuantizationError:
    return UnsupportedQuantizationError(
        f"compressed-tensors checkpoint with {what}: supported: fp8 weights (float-quantized "
        "or naive-quantized, 8-bit float, per tensor, per channel or 128x128 blocks) with "
        "dynamic per-token or static per-tensor fp8 activations, or none"
    )
