"""DeepSeek-V2-Lite on the GPU (dummy weights): MLA and mixture-of-experts in one model.

dsv2lite: batch-1 decode tok/s against the roofline of the bytes one step reads (every
layer's MLA projections, the dense first layer's MLP, each MoE layer's router, the top-k
routed experts and the shared experts, the latent KV cache, the LM head), at the copy
bandwidth measured in the same run; then SGLang's offline workload (500 prompts, input
U[1, 4096], output U[1, 2048]) on the same engine. The MLA decode kernel's own bandwidth at
batch 1, 64 and 256 is the `mla_kernel` section.
"""

from __future__ import annotations

from typing import Any

from loadtest.gpu.moe import (
    DECODE_IN,
    DECODE_OUT,
    OFFLINE_RUN_S,
    decode_and_offline,
    decode_batches,
)

# DeepSeek-V2-Lite's config.json fields (deepseek-ai/DeepSeek-V2-Lite), 15.7B parameters.
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "vocab_size": 102400,
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "num_key_value_heads": 16,
    "n_shared_experts": 2,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "routed_scaling_factor": 1.0,
    "topk_method": "greedy",
    "n_group": 1,
    "topk_group": 1,
    "scoring_func": "softmax",
    "norm_topk_prob": False,
    "moe_layer_freq": 1,
    "first_k_dense_replace": 1,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "original_max_position_embeddings": 4096,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "torch_dtype": "bfloat16",
}


def step_bytes(config: dict[str, Any], context: int) -> dict[str, int]:
    """bf16 bytes one batch-1 decode step reads, by part (the embedding: one row, left out).
    Absorbed MLA reads kv_b_proj once as W_UK and W_UV: the same bytes as the matrix."""
    h, n = config["hidden_size"], config["num_hidden_layers"]
    heads, rank = config["num_attention_heads"], config["kv_lora_rank"]
    nope, rope, v = config["qk_nope_head_dim"], config["qk_rope_head_dim"], config["v_head_dim"]
    dense = config["first_k_dense_replace"]
    inter, moe_inter = config["intermediate_size"], config["moe_intermediate_size"]
    shared = config["n_shared_experts"] * moe_inter
    attention = (
        h * heads * (nope + rope)  # q_proj
        + h * (rank + rope)  # kv_a_proj_with_mqa
        + rank  # kv_a_layernorm
        + rank * heads * (nope + v)  # kv_b_proj (W_UK, W_UV)
        + heads * v * h  # o_proj
    )
    routed = config["num_experts_per_tok"] * 3 * h * moe_inter
    parts = {
        "attention": 2 * n * attention,
        "norms": 2 * (n * 2 * h + h),
        "dense_mlp": 2 * dense * 3 * h * inter,
        "router": 2 * (n - dense) * config["n_routed_experts"] * h,
        "experts": 2 * (n - dense) * (routed + 3 * h * shared),
        "kv_cache": 2 * n * (rank + rope) * context,
        "lm_head": 2 * h * config["vocab_size"],
    }
    parts["total"] = sum(parts.values())
    return parts


def dsv2lite_section(time_limit: float = OFFLINE_RUN_S) -> dict[str, Any]:
    read = step_bytes(DEEPSEEK_V2_LITE, DECODE_IN + DECODE_OUT // 2)
    return decode_and_offline(DEEPSEEK_V2_LITE, "deepseek-v2-lite-dummy", read, time_limit)


def dsv2lite_batches_section() -> dict[str, Any]:
    return decode_batches(DEEPSEEK_V2_LITE, "deepseek-v2-lite-dummy")
