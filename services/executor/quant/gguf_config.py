"""Which projections of a GGUF model stay in their blocks on the device (gguf_linear.py).

llama.cpp picks a type per tensor (a Q4_K_M file keeps most matrices in Q4_K but attn_v and
ffn_down often in Q6_K), so the format is a table: checkpoint module -> ggml type. A
projection stays in blocks when its type has a kernel (Q8_0, Q4_K, Q6_K) and, for a fused one
(qkv_proj, gate_up_proj), when every part has the same type: the kernels read one type per
matrix. Everything else (other types, F16/F32 tensors, embeddings, norms, the LM head, mixed
fused parts) is dequantised at load as before.

`from_gguf` reads the table from a file; `from_hf` (quant_method "gguf" in config.json) gives
one type to every projection, for dummy-weight benchmarks at a model's shapes.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from kernels.gguf_blocks import LAYOUTS
from services.executor.errors import UnsupportedQuantizationError
from services.executor.model_config import ModelConfig
from services.executor.quant.base import LinearMethod, QuantConfig
from services.executor.quant.gguf_linear import GgufMethod

log = logging.getLogger(__name__)

# architectures whose checkpoint stacks projections the model splits (Phi-3's attn_qkv):
# quantize_model refuses stacked checkpoints, so their GGUF files load dequantised
_STACKED_FILES = ("Phi3ForCausalLM",)


@dataclass(frozen=True)
class GgufConfig(QuantConfig):
    family: str = "gguf"
    # checkpoint module name (model.layers.0.self_attn.q_proj) -> ggml type name (Q4_K)
    types: dict[str, str] = field(default_factory=dict)
    default: str | None = None  # the type of modules not in `types` (None: dequantised)
    _methods: dict[str, LinearMethod] = field(
        default_factory=lambda: {t: GgufMethod(t) for t in LAYOUTS}, repr=False, compare=False
    )

    def method_for(self, names: list[str]) -> LinearMethod | None:
        kinds = {self.types.get(n, self.default) for n in names}
        if len(kinds) > 1:
            log.info(
                "%s dequantised: fused parts of types %s", ", ".join(names), sorted(map(str, kinds))
            )
            return None
        kind = kinds.pop()
        return self._methods.get(kind) if kind is not None else None

    def method(self) -> LinearMethod:
        raise NotImplementedError("GGUF projections take their method by type (method_for)")


def from_gguf(reader: Any, config: ModelConfig) -> GgufConfig | None:
    """The block table of a GGUF file's 2-D weights; None (every tensor dequantised, as
    logged) when the model's layers are ones quantized weights do not run on yet."""
    from services.executor.weights.gguf import hf_name

    why = ""
    if config.moe is not None:
        why = "routed experts (MoE)"
    elif config.mla is not None:
        why = "latent attention (MLA)"
    elif config.architecture in _STACKED_FILES:
        why = "projections stacked in the file (attn_qkv)"
    if why:
        log.info("GGUF %s: %s; every tensor is dequantised at load", config.architecture, why)
        return None
    types: dict[str, str] = {}
    for t in reader.tensors:
        name = hf_name(t.name, config.architecture)
        if name.endswith(".weight") and len(t.shape) == 2:
            types[name.removesuffix(".weight")] = t.tensor_type.name
    # the layers' matrices (the embedding and LM head are dequantised whatever their type)
    counts = Counter(t for n, t in types.items() if t in LAYOUTS and ".layers." in n)
    if not counts:
        return None
    blocks = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    return GgufConfig(name=f"gguf ({blocks} matrices in blocks)", types=types)


def from_hf(q: dict[str, Any]) -> GgufConfig:
    """quantization_config {"quant_method": "gguf", "weight_type": "Q4_K"}: every projection
    in that type (dummy weights; GGUF files carry their own types)."""
    kind = str(q.get("weight_type", ""))
    if kind not in LAYOUTS:
        raise UnsupportedQuantizationError(
            f"gguf weight_type {kind!r}: supported: {', '.join(LAYOUTS)}"
        )
    return GgufConfig(name=f"gguf {kind}", default=kind)
