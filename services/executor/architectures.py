"""The model architectures the executor can build, by their HF names, and where each one's
class lives. Imports no model code: the configuration reader checks a name against it without
importing the models, which import the configuration."""

from __future__ import annotations

from services.executor.errors import UnsupportedModelError

# architecture -> (module, class); Mistral without sliding windows is Llama.
MODEL_CLASSES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("services.executor.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("services.executor.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("services.executor.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3ForCausalLM": ("services.executor.models.qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("services.executor.models.phi3", "Phi3ForCausalLM"),
    "DeepseekV2ForCausalLM": ("services.executor.models.deepseek", "DeepseekV2ForCausalLM"),
    "DeepseekV3ForCausalLM": ("services.executor.models.deepseek", "DeepseekV3ForCausalLM"),
    # MoE families: the same attention, SparseMoE MLPs where ModelConfig.moe says so.
    "Qwen2MoeForCausalLM": ("services.executor.models.qwen2", "Qwen2ForCausalLM"),
    "Qwen3MoeForCausalLM": ("services.executor.models.qwen3", "Qwen3ForCausalLM"),
    "MixtralForCausalLM": ("services.executor.models.mixtral", "MixtralForCausalLM"),
    "Gemma2ForCausalLM": ("services.executor.models.gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("services.executor.models.gemma", "Gemma3ForCausalLM"),
}

SUPPORTED_ARCHITECTURES: tuple[str, ...] = tuple(sorted(MODEL_CLASSES))


def check_architecture(arch: str) -> None:
    """Raise UnsupportedModelError unless `arch` is one we can build."""
    if arch not in MODEL_CLASSES:
        raise UnsupportedModelError(
            f"unsupported model architecture {arch!r}; "
            f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
