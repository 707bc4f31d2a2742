"""Model registry: HF architecture name -> model class, imported only when asked for.

Every model class takes `(config: ModelConfig, backend: AttentionBackend)` and exposes
`forward(batch: ForwardBatch) -> logits [batch_size, vocab] float32` for each request's last
new token. Parameter names match HF's so a HF state dict loads without renaming. The names
and modules are listed in services/executor/architectures.py.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from services.executor.architectures import MODEL_CLASSES, check_architecture

if TYPE_CHECKING:
    from services.executor.models.llama import LlamaForCausalLM


def get_model_class(arch: str) -> type[LlamaForCausalLM]:
    """The model class for an HF architecture name (all of them derive from Llama's)."""
    check_architecture(arch)
    module_name, class_name = MODEL_CLASSES[arch]
    cls: type[LlamaForCausalLM] = getattr(importlib.import_module(module_name), class_name)
    return cls
