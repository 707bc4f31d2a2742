"""Mixtral: Llama attention with a SparseMoE MLP in every layer (ModelConfig.moe).

Its checkpoints name the MoE `block_sparse_moe` and the experts' projections w1 (gate),
w3 (up), w2 (down); they are read under Qwen-MoE's names, which the model uses.
"""

from __future__ import annotations

from services.executor.models.llama import LlamaForCausalLM


class MixtralForCausalLM(LlamaForCausalLM):
    checkpoint_renames = (
        (".block_sparse_moe.", ".mlp."),
        (".w1.", ".gate_proj."),
        (".w3.", ".up_proj."),
        (".w2.", ".down_proj."),
    )
