"""shared/tokenizer_cache.py: the saved tokenizer behaves as the one AutoTokenizer built (a
tiny HF model's, and the default model's GGUF vocabulary), later loads skip the conversion
and torch, an edited file makes a new entry, processes starting together convert once, and
without a writable cache every load converts as before."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shared import caches, tokenizer_cache
from shared.model_files import (
    ModelSource,
    convert_tokenizer,
    default_model_path,
    resolve_model,
)
from tests.executor.helpers import write_tiny_model

TEXTS = [
    "Hello world",
    "  leading and   inner   spaces\n\ttabs and newlines\n\n",
    "<s>special<|im_end|> tokens </s> inside text<|im_start|>user",
    "ünïcödé — 世界 🙂 emoji",
    "The capital of France is",
    "",
]
CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "4"},
    {"role": "user", "content": "And 3 + 3?"},
]


@pytest.fixture
def cache_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv(caches.CACHE_ENV, str(root))
    return root / "tokenizers"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tok-cache"), "llama", 3)


def counting_convert(source: ModelSource, calls: list[int]) -> Any:
    def convert() -> Any:
        calls.append(1)
        return convert_tokenizer(source)

    return convert


def behaviour(tok: Any) -> dict[str, Any]:
    """Everything the services read of a tokenizer, as plain data."""
    vocab = len(tok)
    ids = list(range(vocab))
    return {
        "class": type(tok).__name__,
        "len": vocab,
        "special": (tok.all_special_ids, tok.all_special_tokens),
        "ids": (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id),
        "added": {i: str(t) for i, t in tok.added_tokens_decoder.items()},
        "tokens": tok.convert_ids_to_tokens(ids),
        "encode": [tok(t).input_ids for t in TEXTS],
        "encode_plain": [tok(t, add_special_tokens=False).input_ids for t in TEXTS],
        "decode": [tok.decode(ids[i : i + 37]) for i in range(0, vocab, 997)],
        "decode_skip": [tok.decode(ids[-60:], skip_special_tokens=s) for s in (True, False)],
        "chat": tok.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True),
        "chat_template": tok.chat_template,
        "cleanup": tok.clean_up_tokenization_spaces,
        "backend": json.loads(tok.backend_tokenizer.to_str()),
    }


def model_source(which: str, tiny_dir: Path) -> ModelSource:
    return resolve_model(str(tiny_dir) if which == "tiny-hf" else default_model_path())


@pytest.mark.parametrize("which", ["tiny-hf", "default-gguf"])
def test_the_saved_tokenizer_is_the_converted_one(
    which: str, tiny_dir: Path, cache_dir: Path, tmp_path: Path
) -> None:
    source = model_source(which, tiny_dir)
    calls: list[int] = []
    convert = counting_convert(source, calls)
    first = tokenizer_cache.load(source.path, source.kind, convert)
    again = tokenizer_cache.load(source.path, source.kind, convert)
    assert calls == [1]  # the second load read the saved copy
    assert len(list(cache_dir.iterdir())) == 2  # the entry and its lock file
    assert behaviour(again) == behaviour(first)
    # what the gateway's gRPC GetTokenizer zips: the same bytes, so the same digest
    assert saved_files(again, tmp_path / "again") == saved_files(first, tmp_path / "first")


def saved_files(tok: Any, where: Path) -> dict[str, bytes]:
    tok.save_pretrained(where)
    return {p.name: p.read_bytes() for p in sorted(where.iterdir())}


def test_a_cached_load_imports_neither_torch_nor_the_config(
    tiny_dir: Path, cache_dir: Path
) -> None:
    """In a fresh interpreter, as a tokenizer or detokenizer process starts."""
    source = resolve_model(str(tiny_dir))
    tokenizer_cache.load(source.path, source.kind, counting_convert(source, []))
    code = (
        "import sys\n"
        "from shared.model_files import load_tokenizer, resolve_model\n"
        f"tok = load_tokenizer(resolve_model({str(tiny_dir)!r}))\n"
        "print(type(tok).__name__, 'torch' in sys.modules, tok('Hello world').input_ids)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env=os.environ
    ).stdout.split(maxsplit=2)
    want = convert_tokenizer(source)("Hello world").input_ids
    assert out == ["TokenizersBackend", "False", f"{want}\n"]


def test_an_edited_file_makes_a_new_entry(tmp_path: Path, cache_dir: Path) -> None:
    model = write_tiny_model(tmp_path, "llama", 4)
    source = resolve_model(str(model))
    calls: list[int] = []
    tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    config = model / "tokenizer_config.json"
    edited = json.loads(config.read_text())
    edited["clean_up_tokenization_spaces"] = True
    config.write_text(json.dumps(edited))
    tok = tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    assert calls == [1, 1] and tok.clean_up_tokenization_spaces is True
    # a weight file is not part of the key: its tokenizer stays cached
    (model / "model.safetensors").write_bytes((model / "model.safetensors").read_bytes())
    tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    assert calls == [1, 1]


def test_the_same_files_under_another_path_load_the_saved_copy(
    tmp_path: Path, cache_dir: Path
) -> None:
    model = write_tiny_model(tmp_path / "a", "llama", 4)
    copy = Path(shutil.copytree(model, tmp_path / "b" / model.name))
    calls: list[int] = []
    for path in (model, copy):
        source = resolve_model(str(path))
        tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    assert calls == [1]  # the copy converted nothing
    # the copy edited: its own entry, the original's kept
    (copy / "tokenizer_config.json").write_text(
        json.dumps({**json.loads((copy / "tokenizer_config.json").read_text()), "x": 1})
    )
    source = resolve_model(str(copy))
    tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    assert calls == [1, 1] and len([p for p in cache_dir.iterdir() if p.is_dir()]) == 2


def test_processes_starting_together_convert_once(tiny_dir: Path, cache_dir: Path) -> None:
    code = (
        "import sys\n"
        "from shared import tokenizer_cache\n"
        "from shared.model_files import convert_tokenizer, resolve_model\n"
        f"source = resolve_model({str(tiny_dir)!r})\n"
        "def convert():\n"
        "    print('converted')\n"
        "    return convert_tokenizer(source)\n"
        "tok = tokenizer_cache.load(source.path, source.kind, convert)\n"
        "print(tok('The capital of France is').input_ids)\n"
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, env=os.environ
        )
        for _ in range(3)
    ]
    outs = [p.communicate(timeout=120)[0].splitlines() for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0]
    assert sum(lines.count("converted") for lines in outs) == 1
    assert len({lines[-1] for lines in outs}) == 1


def test_another_class_is_not_cached(tiny_dir: Path, cache_dir: Path) -> None:
    """A model's own tokenizer subclass may behave beyond what it saves: never cached."""
    source = resolve_model(str(tiny_dir))
    generic = convert_tokenizer(source)
    subclass: Any = type("OwnTokenizer", (type(generic),), {})
    calls: list[int] = []

    def convert() -> Any:
        calls.append(1)
        return subclass.from_pretrained(str(tiny_dir))

    for _ in range(2):
        assert type(tokenizer_cache.load(source.path, source.kind, convert)) is subclass
    assert calls == [1, 1]
    assert [p.name for p in cache_dir.iterdir()] == [
        f"{tokenizer_cache.entry_key(source.path, 'hf')}.lock"
    ]


def test_without_a_writable_cache_every_load_converts(
    tiny_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv(caches.CACHE_ENV, str(blocker / "below-a-file"))
    source = resolve_model(str(tiny_dir))
    calls: list[int] = []
    for _ in range(2):
        tok = tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
        assert tok("Hello world").input_ids
    assert calls == [1, 1]


def test_a_damaged_entry_is_converted_and_saved_again(tiny_dir: Path, cache_dir: Path) -> None:
    source = resolve_model(str(tiny_dir))
    calls: list[int] = []
    first = tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    entry = cache_dir / tokenizer_cache.entry_key(source.path, source.kind)
    (entry / "tokenizer.json").write_text("{not json")
    again = tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    third = tokenizer_cache.load(source.path, source.kind, counting_convert(source, calls))
    assert calls == [1, 1]
    assert behaviour(again) == behaviour(first) == behaviour(third)
