"""Test helpers: tiny random HF models with a real tokenizer, and a greedy driver that runs a
model through EXTEND/DECODE ForwardBatches the way the engine will.

`write_tiny_model(tmp_path)` gives a directory that both transformers and `load_model` load,
with a byte-level BPE tokenizer and a ChatML template, for end-to-end tests.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    AutoModelForCausalLM,
    DeepseekV2Config,
    DeepseekV3Config,
    Gemma2Config,
    Gemma3TextConfig,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Phi3Config,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from services.executor.forward_batch import ForwardBatch, ForwardMode
from services.executor.kv_pool import ReqToTokenPool, make_kv_pool
from services.executor.model_config import ModelConfig

# --- tokenizer: 256 byte tokens (id = byte value), 4 merges, 4 special tokens = 264 ---------

MERGES = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n")]
SPECIAL_TOKENS = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
TINY_VOCAB_SIZE = 256 + len(MERGES) + len(SPECIAL_TOKENS)
BOS_ID, PAD_ID, IM_START_ID, EOS_ID = 260, 261, 262, 263  # eos is <|im_end|>, as in ChatML
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _byte_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte, indexed by byte value."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    out: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in out:
            out[b] = chr(256 + extra)
            extra += 1
    return [out[b] for b in range(256)]


def make_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE over TINY_VOCAB_SIZE ids, bos `<s>`, eos `<|im_end|>`, ChatML template."""
    vocab = {ch: i for i, ch in enumerate(_byte_to_unicode())}
    for a, b in MERGES:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|im_end|>",
        pad_token="</s>",
        chat_template=CHATML_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )


# --- tiny HF models --------------------------------------------------------------------------

_CONFIG_CLASSES: dict[str, type[PretrainedConfig]] = {
    "llama": LlamaConfig,
    "mistral": MistralConfig,
    "qwen2": Qwen2Config,
    "qwen3": Qwen3Config,
    "phi3": Phi3Config,
    "deepseek_v2": DeepseekV2Config,
    "deepseek_v3": DeepseekV3Config,
    "qwen2_moe": Qwen2MoeConfig,
    "qwen3_moe": Qwen3MoeConfig,
    "mixtral": MixtralConfig,
    "gemma2": Gemma2Config,
    "gemma3": Gemma3TextConfig,
}
# Tiny expert counts and sizes for the MoE families (their defaults are the real models').
_MOE_DEFAULTS: dict[str, dict[str, Any]] = {
    "qwen2_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 32,
        "shared_expert_intermediate_size": 48,
    },
    "qwen3_moe": {
        "num_experts": 8,
        "num_experts_per_tok": 3,
        "moe_intermediate_size": 32,
        "norm_topk_prob": True,
    },
    "mixtral": {"num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None},
}
DEEPSEEK_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "original_max_position_embeddings": 64,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 0.9,
    "mscale_all_dim": 0.7,
}
# DeepSeek's latent attention, every layer dense (first_k_dense_replace >= the layers): 4
# heads of 12 + 8 (rotated), values of 16, a latent of 32; V3's tests add q_lora_rank.
DEEPSEEK_TINY: dict[str, Any] = {
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 12,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "q_lora_rank": None,
    "first_k_dense_replace": 2,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "head_dim": 8,  # transformers: the rotated part's width
}

# Gemma's tiny shape: a window of 8 (shorter than most test prompts), a query scale that is
# not head_dim's, soft caps small enough to bite on these logits.
GEMMA_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma2": {
        "sliding_window": 8,
        "query_pre_attn_scalar": 24,
        "attn_logit_softcapping": 4.0,
        "final_logit_softcapping": 6.0,
    },
    "gemma3": {
        "num_hidden_layers": 3,
        "sliding_window": 8,
        "layer_types": ["sliding_attention", "full_attention", "sliding_attention"],
        "query_pre_attn_scalar": 24,
        "final_logit_softcapping": 6.0,
        "rope_parameters": {
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0},
            "sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
        },
    },
}

LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 10000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 64,
}


def longrope(rotary_dim: int = 16, original: int = 64) -> dict[str, Any]:
    """Phi-3's LongRoPE parameters for a tiny model: short and long factors that differ in
    every frequency (rotary_dim / 2 of each), the original context `original`."""
    n = rotary_dim // 2
    return {
        "rope_type": "longrope",
        "rope_theta": 10000.0,
        "short_factor": [1.0 + 0.05 * i for i in range(n)],
        "long_factor": [1.5 + 0.5 * i for i in range(n)],
        "original_max_position_embeddings": original,
    }


def make_hf_config(arch: str = "llama", **overrides: Any) -> PretrainedConfig:
    """A tiny config: hidden 64, 2 layers, 4 heads of 16, 2 KV heads, vocab TINY_VOCAB_SIZE."""
    kwargs: dict[str, Any] = {
        "vocab_size": TINY_VOCAB_SIZE,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }
    if arch == "mistral":
        kwargs["sliding_window"] = None
    kwargs.update(_MOE_DEFAULTS.get(arch, {}))
    if arch.startswith("deepseek"):
        kwargs.update(DEEPSEEK_TINY, num_key_value_heads=4)
    kwargs.update(GEMMA_DEFAULTS.get(arch, {}))
    kwargs.update(overrides)
    return _CONFIG_CLASSES[arch](**kwargs)


def make_hf_model(arch: str = "llama", seed: int = 0, **overrides: Any) -> PreTrainedModel:
    """A tiny fp32 HF model with every weight random: N(0, 0.1), norms 1 + N(0, 0.1), so
    logits are spread out (greedy has clear winners) and biases/norms are really tested
    (Gemma's norms scale by 1 + w: theirs are N(0, 0.1))."""
    config = make_hf_config(arch, **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=gen) * 0.1
            is_norm = name.endswith("norm.weight") and not arch.startswith("gemma")
            param.copy_(1.0 + noise if is_norm else noise)
    return model.eval()


def write_tiny_model(tmp_path: Path, arch: str = "llama", seed: int = 0, **overrides: Any) -> Path:
    """Save a tiny random model (safetensors) plus tokenizer under tmp_path; return the dir.

    arch: "llama", "mistral", "qwen2", "qwen3", "phi3", "gemma2", "gemma3", "qwen2_moe",
    "qwen3_moe", "mixtral", "deepseek_v2" or "deepseek_v3"; overrides go to the HF config
    class.
    """
    path = Path(tmp_path) / f"tiny-{arch}-{seed}"
    make_hf_model(arch, seed, **overrides).save_pretrained(path, safe_serialization=True)
    make_tokenizer().save_pretrained(path)
    return path


def hf_last_logits(model: torch.nn.Module, prompt: Sequence[int]) -> torch.Tensor:
    """transformers' logits for the prompt's last token: [vocab] fp32."""
    with torch.no_grad():
        return model(torch.tensor([list(prompt)])).logits[0, -1].float()


def hf_argmax_continuation(model: torch.nn.Module, prompt: Sequence[int], n: int) -> list[int]:
    """transformers' argmax at each of n positions after the prompt, EOS included (what
    `ignore_eos` decoding gives), one token a forward pass over its KV cache."""
    out: list[int] = []
    with torch.no_grad():
        step = model(torch.tensor([list(prompt)]), use_cache=True)
        for _ in range(n):
            token = int(step.logits[0, -1].argmax())
            out.append(token)
            step = model(torch.tensor([[token]]), use_cache=True, **_cache_of(step))
    return out


def _cache_of(step: Any) -> dict[str, Any]:
    """The KV cache of a transformers forward's output, as the next call takes it: `cache`
    in the transformers this project installs, `past_key_values` in earlier releases (the
    one on the GPU machines)."""
    cache = getattr(step, "cache", None)
    return {"past_key_values": step.past_key_values} if cache is None else {"cache": cache}


def hf_greedy(model: torch.nn.Module, prompt: Sequence[int], max_new_tokens: int) -> list[int]:
    """transformers' greedy continuation (stops after eos, like greedy_generate)."""
    generative: Any = model  # any transformers causal LM; its generate() is loosely typed
    with torch.no_grad():
        out = generative.generate(
            torch.tensor([list(prompt)]),
            attention_mask=torch.ones(1, len(prompt), dtype=torch.int64),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=EOS_ID,
            pad_token_id=PAD_ID,
        )
    return [int(t) for t in out[0, len(prompt) :]]


# --- driving a model through ForwardBatches --------------------------------------------------


class BatchDriver:
    """Owns a KVPool and ReqToTokenPool and builds ForwardBatches for a model, as the engine
    will: `new_request()` gives a row, `extend`/`decode` run one forward over several rows."""

    def __init__(
        self,
        model: torch.nn.Module,
        config: ModelConfig,
        *,
        num_slots: int = 2048,
        max_reqs: int = 8,
        max_context: int = 512,
        device: str = "cpu",
        kv_dtype: torch.dtype | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        dtype = kv_dtype or next(model.parameters()).dtype  # None: the model's
        self.kv_pool = make_kv_pool(config, num_slots, dtype, device)
        self.req_to_token = ReqToTokenPool(max_reqs, max_context, device)
        self.cached: dict[int, int] = {}  # row -> tokens already in the KV pool
        self.slots: dict[int, list[int]] = {}  # row -> its KV slots, in order

    def new_request(self) -> int:
        row = self.req_to_token.allocate()
        self.cached[row], self.slots[row] = 0, []
        return row

    def free(self, row: int) -> None:
        self.kv_pool.free(self.slots.pop(row))
        del self.cached[row]
        self.req_to_token.free(row)

    def extend(self, rows: Sequence[int], chunks: Sequence[Sequence[int]]) -> torch.Tensor:
        """Append chunks[i] to request rows[i] (after its cached tokens); last-token logits."""
        return self._forward(ForwardMode.EXTEND, rows, chunks)

    def decode(self, rows: Sequence[int], tokens: Sequence[int]) -> torch.Tensor:
        return self._forward(ForwardMode.DECODE, rows, [[t] for t in tokens])

    def _forward(
        self, mode: ForwardMode, rows: Sequence[int], chunks: Sequence[Sequence[int]]
    ) -> torch.Tensor:
        input_ids: list[int] = []
        positions: list[int] = []
        out_cache_loc: list[int] = []
        prefix_lens = [self.cached[row] for row in rows]
        for row, chunk, prefix in zip(rows, chunks, prefix_lens, strict=True):
            new_slots = self.kv_pool.allocate(len(chunk))
            self.req_to_token.write(row, prefix, new_slots)
            self.slots[row] += new_slots
            self.cached[row] = prefix + len(chunk)
            input_ids += chunk
            positions += range(prefix, prefix + len(chunk))
            out_cache_loc += new_slots
        self.req_to_token.flush()
        extend_lens = [len(c) for c in chunks]

        def tensor(values: Sequence[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=self.device)

        batch = ForwardBatch(
            mode=mode,
            input_ids=tensor(input_ids),
            positions=tensor(positions),
            out_cache_loc=tensor(out_cache_loc),
            req_rows=tensor(rows),
            seq_lens=tensor([p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]),
            prefix_lens_cpu=prefix_lens,
            extend_lens_cpu=extend_lens,
            kv_pool=self.kv_pool,
            req_to_token=self.req_to_token,
        )
        with torch.inference_mode():
            logits: torch.Tensor = self.model(batch)
        return logits


def greedy_generate(
    model: torch.nn.Module,
    config: ModelConfig,
    prompts: Sequence[Sequence[int]],
    max_new_tokens: int,
    eos_ids: Sequence[int] = (EOS_ID,),
    kv_dtype: torch.dtype | None = None,
    device: str = "cpu",
) -> list[list[int]]:
    """Greedy continuations of all prompts, batched: one EXTEND over every prompt, then DECODE
    steps over the requests still running. A request stops after emitting an eos id.
    kv_dtype: the KV pool's dtype (None: the model's); device: the model's."""
    max_context = max(len(p) for p in prompts) + max_new_tokens
    driver = BatchDriver(
        model,
        config,
        max_reqs=len(prompts),
        max_context=max_context,
        kv_dtype=kv_dtype,
        device=device,
    )
    rows = [driver.new_request() for _ in prompts]
    logits = driver.extend(rows, prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    running = list(range(len(prompts)))
    while True:
        next_tokens = logits.argmax(-1).tolist()
        still = []
        for i, token in zip(running, next_tokens, strict=True):
            outputs[i].append(token)
            if token not in eos_ids and len(outputs[i]) < max_new_tokens:
                still.append(i)
        running = still
        if not running:
            return outputs
        logits = driver.decode([rows[i] for i in running], [outputs[i][-1] for i in running])
