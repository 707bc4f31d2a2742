"""Qwen2: Llama with biases on the q/k/v projections (ModelConfig sets attention_bias)."""

from __future__ import annotations

from services.executor.attention import AttentionBackend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.model_config import ModelConfig
from services.executor.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(
        self, config: ModelConfig, backend: AttentionBackend, tp: TPGroup = SINGLE
    ) -> None:
        if not config.attention_bias:
            raise ValueError("Qwen2 has q/k/v biases: config.attention_bias must be true")
        super().__init__(config, backend, tp)
