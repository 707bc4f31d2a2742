"""Model directories for GPU runs: Llama-3.1-8B's config (dummy weights) plus a tokenizer."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

LLAMA_3_1_8B: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    },
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


WORD_VOCAB_SIZE = 32000


def llama8b_dir(root: Path, tokenizer: str = "bytes") -> Path:
    """config.json of Llama-3.1-8B and a small tokenizer whose ids all lie inside the real
    vocabulary: enough for dummy-weight serving, where text content is irrelevant.

    "bytes": byte-level BPE (about 300 ids), which can spell any text: structured output.
    "words": one id per word, WORD_VOCAB_SIZE of them, each of which decodes to text, as
    nearly every token of a real model's vocabulary does. Random byte tokens do not: half of
    them are pieces of a UTF-8 character, which streams hold back until it is complete, so
    streamed chunks would carry two tokens each and inter-token latency would read double.
    "bpe": byte-level BPE filling the whole vocabulary, as Llama 3's does (see
    make_bpe_tokenizer): structured output at a real vocabulary's grammar costs.
    """
    path = root / f"llama-3.1-8b-dummy-{tokenizer}"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(LLAMA_3_1_8B, indent=1))
    if tokenizer == "bytes":
        from tests.executor.helpers import make_tokenizer

        make_tokenizer().save_pretrained(path)
    elif tokenizer == "words":
        make_word_tokenizer().save_pretrained(path)
    elif tokenizer == "bpe":
        make_bpe_tokenizer(
            LLAMA_3_1_8B["bos_token_id"], LLAMA_3_1_8B["vocab_size"]
        ).save_pretrained(path)
    else:
        raise ValueError(f"tokenizer must be 'bytes', 'words' or 'bpe', got {tokenizer!r}")
    return path


def make_word_tokenizer() -> Any:
    """A word-level tokenizer: loadtest.textgen's words and punctuation, then made-up words
    up to WORD_VOCAB_SIZE ids, so the benchmark prompts tokenize without unknown words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from loadtest import textgen

    specials = ["<unk>", "<s>", "</s>"]
    words: list[str] = []
    for group in (
        textgen.ADJECTIVES,
        textgen.NOUNS,
        textgen.VERBS,
        textgen.ADVERBS,
        textgen.NAMES,
        textgen.CONNECTORS,
        *([p.split() for p in (*textgen.PLACES, *textgen.TIMES, *textgen.TEMPLATES)]),
    ):
        for w in group:
            for piece in pre_tokenizers.Whitespace().pre_tokenize_str(w):
                words.append(piece[0])
    words += [w.lower() for w in words] + [w.capitalize() for w in words]
    words += list(".,;:?!'\"-()")
    vocab: dict[str, int] = {}
    for w in [*specials, *words]:
        if not w.startswith("{"):
            vocab.setdefault(w, len(vocab))
    syllables = ["ka", "lo", "mi", "ru", "te", "sa", "no", "vi", "de", "po", "zu", "ri"]
    i = 0
    while len(vocab) < WORD_VOCAB_SIZE:
        n, parts = i, []
        while True:
            parts.append(syllables[n % len(syllables)])
            n //= len(syllables)
            if n == 0:
                break
        vocab.setdefault("".join(parts) + "x", len(vocab))
        i += 1
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece(prefix="##", cleanup=False)  # joins words with spaces
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>"
    )


# The characters BPE_MERGES combines: what JSON and English text are mostly made of.
BPE_CHARS = "ĠetaoinsrhldcumfpgwybvkxjqzETAOINSRHLDCUMFPGWYBVK0123456789,.:;\"'{}[]-_()!?/ĊĉĠ"


def make_bpe_tokenizer(first_special: int, vocab_size: int) -> Any:
    """Byte-level BPE whose ordinary tokens fill every id below `first_special` (Llama 3:
    128,000), then special tokens up to `vocab_size` (bos, eos, then reserved ones).

    The merges pair BPE_CHARS two by two, then extend each pair by one more, in a fixed order:
    made-up tokens, but a vocabulary as full as a real one. The byte tokenizer leaves most ids
    empty, and xgrammar counts every empty id as a special token, which costs it about 15 us
    per accepted token at this size (0.5 us with a real tokenizer): the grammar's host work
    would read as 30 times what a served model pays.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    from tests.executor.helpers import _byte_to_unicode

    vocab = {ch: i for i, ch in enumerate(_byte_to_unicode())}
    chars = list(dict.fromkeys(BPE_CHARS))
    pairs = [(a, b) for a in chars for b in chars]
    triples = ((a + b, c) for a, b in pairs for c in chars)
    # Every merged string is new (two or three characters), so ids stay dense.
    merges = list(itertools.islice(itertools.chain(pairs, triples), first_special - len(vocab)))
    assert len(vocab) + len(merges) == first_special, "BPE_CHARS too few for this vocabulary"
    for a, b in merges:
        vocab[a + b] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|end_of_text|>"]
    specials += [f"<|reserved_special_token_{i}|>" for i in range(vocab_size - first_special - 2)]
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=specials[0], eos_token=specials[1]
    )


def weight_bytes(config: dict[str, Any]) -> int:
    """bf16 bytes of weights read per decode step (embedding rows excluded: one row each)."""
    h, i, n = config["hidden_size"], config["intermediate_size"], config["num_hidden_layers"]
    heads, kv, hd = config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]
    attn = h * heads * hd * 2 + h * kv * hd * 2  # q, o; k, v
    mlp = 3 * h * i
    lm_head = h * config["vocab_size"]
    return 2 * (n * (attn + mlp + 2 * h) + h + lm_head)
