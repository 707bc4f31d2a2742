"""Model registry: HF architecture name -> model class, imported only when asked for.

Every model class takes `(config: ModelConfig, backend: AttentionBackend)` and exposes
`forward(batch: ForwardBatch) -> logits [batch_size, vocab] float32` for each request's last
new token. Parameter names match HF's so a HF state dict loads without renaming.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.executor.errors import UnsupportedModelError

if TYPE_CHECKING:
    from services.executor.models.llama import LlamaForCausalLM

# architecture -> (module, class); Mistral without sliding windows is Llama.
_MODEL_REGISTRY: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("services.executor.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("services.executor.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("services.executor.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("services.executor.models.qwen3", "Qwen3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(_MODEL_REGISTRY))


def check_architecture(arch: str) -> None:
    """Raise UnsupportedModelError unless `arch` is one we can build."""
    if arch not in _MODEL_REGISTRY:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )


def get_model_class(arch: str) -> type[LlamaForCausalLM]:
    """The model class for an HF architecture name (all of them derive from Llama's)."""
    check_architecture(arch)
    module_name, class_name = _MODEL_REGISTRY[arch]
    cls: type[LlamaForCausalLM] = getattr(importlib.import_module(module_name), class_name)
    return cls
