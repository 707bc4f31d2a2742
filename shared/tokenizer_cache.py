"""A model's tokenizer, saved once as transformers resolved it, and loaded from there after.

`AutoTokenizer.from_pretrained` reads the model's config to choose the tokenizer class, and
in transformers 5 the config imports torch: 2.5 s of CPU in every tokenizer and detokenizer
process of the development machine, for a tokenizer that loads in 0.2 s. A GGUF file's
tokenizer is worse: transformers builds it from the file's vocabulary on every load (4.5 s of
CPU for the default model), in each of the services that load it.

So the first load goes through AutoTokenizer and, where the class it chose is the generic
fast tokenizer (`TokenizersBackend`: the tokenizer.json backend with the special tokens and
chat template of tokenizer_config.json, which `save_pretrained` writes out whole), saves it
under the cache directory. Later loads of the same files read that copy with the same class,
without the config and without torch. Any other class (a model's own subclass, remote code)
is never cached: its behaviour is more than what it saves.

The entry's key hashes what the tokenizer is built from: the name and bytes of every file of
the directory but the weights (a file past `HASHED_BYTES`, its size and modification time),
or a GGUF file's path, size and modification time (hashing gigabytes is not worth a
tokenizer), and the versions of transformers and tokenizers. An edited file or an upgrade
makes a new entry, and the same files under another path (a copy, another mount of the same
volume) find the entry the first path saved.
An entry appears whole (written aside, then renamed into place); processes that miss it at
the same time take a file lock, so that one of them converts and the rest load its copy.
Where the cache directory cannot be written, every load converts, as before.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from shared.caches import cache_home, locked

log = logging.getLogger(__name__)

# Weights and other large files no tokenizer reads: left out of the key (hashing their stat is
# cheap, but a re-saved checkpoint should not invalidate its tokenizer).
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".h5", ".msgpack", ".ckpt")
# Files up to this size are keyed by their bytes (Llama 3's tokenizer.json is 9 MB: hashed in
# about 20 ms), larger ones by their size and modification time.
HASHED_BYTES = 64 << 20


def cache_root() -> Path:
    """$RADIXSERVE_CACHE_DIR/tokenizers, else $XDG_CACHE_HOME (~/.cache)/radixserve/tokenizers."""
    return cache_home() / "tokenizers"


def entry_key(path: str, kind: str) -> str:
    """What the tokenizer is built from: the files' names and bytes (a GGUF file's path, size
    and modification time), and the library versions that build it."""
    h = hashlib.sha256()
    h.update(f"{kind}\0".encode())
    for lib in ("transformers", "tokenizers"):
        h.update(f"{lib}={metadata.version(lib)}\0".encode())
    if kind == "gguf":
        st = os.stat(path)
        h.update(f"{os.path.abspath(path)}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
        return h.hexdigest()[:32]
    for f in sorted(_tokenizer_files(path)):
        st = os.stat(f)
        h.update(f"{os.path.basename(f)}\0{st.st_size}\0".encode())
        if st.st_size > HASHED_BYTES:
            h.update(f"mtime {st.st_mtime_ns}\0".encode())
            continue
        with open(f, "rb") as fh:
            h.update(hashlib.file_digest(fh, "sha256").digest())
    return h.hexdigest()[:32]


def _tokenizer_files(directory: str) -> Iterator[str]:
    for entry in os.scandir(directory):
        if entry.is_file() and not entry.name.endswith(WEIGHT_SUFFIXES):
            yield entry.path


def load(path: str, kind: str, convert: Callable[[], Any]) -> Any:
    """The tokenizer of the model at `path` (a directory, or a .gguf file for kind "gguf"):
    the cached copy when there is one, else `convert()`'s, saved for next time."""
    try:
        key = entry_key(path, kind)
        root = cache_root()
        cached = _load_entry(root / key)
        if cached is not None:
            return cached
        root.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # no cache here (a read-only home, say): load as transformers does
        log.debug("tokenizer cache unavailable (%s): converting %s", e, path)
        return convert()
    with locked(root / f"{key}.lock"):
        cached = _load_entry(root / key)  # another process may have saved it meanwhile
        if cached is not None:
            return cached
        tokenizer = convert()
        _save_entry(root, key, tokenizer)
        return tokenizer


def _generic_class() -> Any:
    # from its own module: transformers' top level imports torch
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    return TokenizersBackend


def _load_entry(entry: Path) -> Any | None:
    if not (entry / "tokenizer_config.json").is_file():
        return None
    try:
        return _generic_class().from_pretrained(str(entry))
    except Exception as e:  # a damaged entry: converted and saved again under the lock
        log.warning("cached tokenizer %s does not load (%r): converting again", entry, e)
        return None


def _save_entry(root: Path, key: str, tokenizer: Any) -> None:
    if type(tokenizer) is not _generic_class():
        log.debug("tokenizer class %s is not cached", type(tokenizer).__name__)
        return
    tmp = tempfile.mkdtemp(prefix=".tmp-", dir=root)
    try:
        tokenizer.save_pretrained(tmp)
        shutil.rmtree(root / key, ignore_errors=True)  # a damaged entry (we hold the lock)
        os.rename(tmp, root / key)  # whole or not at all
        log.info("tokenizer saved to %s: later starts load it from there", root / key)
    except OSError as e:
        log.debug("tokenizer not cached (%s)", e)
        shutil.rmtree(tmp, ignore_errors=True)
