"""Compiling constraints with xgrammar, and the format of the compiled-grammar cache.

The grammar service compiles and caches; executors load from the cache (and compile only when
an entry is gone). Both sides must build the same `GrammarTokenizer` from the model, so a key
computed by one names a grammar the other can load: the key hashes the constraint's kind and
source, the tokenizer's fingerprint, and the compile format.
"""

from __future__ import annotations

import hashlib
import json
import re
import zlib
from dataclasses import dataclass
from typing import Any

import xgrammar as xgr

from shared.messages.common import (
    ChoiceConstraint,
    Constraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)
from shared.model_files import ModelSource, eos_token_ids, load_tokenizer, read_vocab_size

# Part of every key: bump it when the compile options below change what a grammar allows.
# JSON is generated compactly (`{"a": 1, "b": [2, 3]}`, no free whitespace): free whitespace
# lets weak models loop on newlines, and a fixed layout is what makes jump-forward pay off.
COMPILE_FORMAT = "2:json-compact:bounded-strings-json-safe"


@dataclass(frozen=True)
class GrammarTokenizer:
    """The model's tokenizer as xgrammar sees it. `info.vocab_size` is the model's vocabulary
    (the logits' width), which may exceed the tokenizer's; the extra ids are never allowed."""

    tokenizer: Any  # the HF tokenizer (jump-forward re-tokenizes forced text with it)
    info: xgr.TokenizerInfo
    fingerprint: str  # hash of the vocabulary, vocab type and stop tokens

    @classmethod
    def build(cls, tokenizer: Any, vocab_size: int, stop_token_ids: list[int]) -> GrammarTokenizer:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids or None
        )
        return cls(tokenizer, info, tokenizer_fingerprint(info))

    @classmethod
    def load(cls, source: ModelSource) -> GrammarTokenizer:
        """From the model files, reading no weights."""
        tokenizer = load_tokenizer(source)
        return cls.build(tokenizer, read_vocab_size(source), eos_token_ids(source, tokenizer))


def tokenizer_fingerprint(info: xgr.TokenizerInfo) -> str:
    h = hashlib.sha256(info.dump_metadata().encode())
    for token in info.decoded_vocab:
        h.update(len(token).to_bytes(4, "little"))
        h.update(token)
    return h.hexdigest()[:32]


class GrammarError(ValueError):
    """The compiler refused a constraint; the message says what is wrong (for a 400)."""


def constraint_source(c: Constraint) -> str:
    """The text the compiler reads (choices become an EBNF alternation)."""
    if isinstance(c, JsonSchemaConstraint):
        return c.schema
    if isinstance(c, RegexConstraint):
        return c.pattern
    if isinstance(c, EbnfConstraint):
        return c.grammar
    # JSON string escapes are valid EBNF string escapes; ensure_ascii=False keeps characters
    # outside the BMP as themselves rather than as surrogate pairs.
    return "root ::= " + " | ".join(json.dumps(s, ensure_ascii=False) for s in c.choices)


def constraint_kind(c: Constraint) -> str:
    """The constraint's wire tag: "json_schema", "regex", "ebnf" or "choice"."""
    return str(c.__struct_config__.tag)


def grammar_key(c: Constraint, fingerprint: str) -> str:
    """Same constraint + same tokenizer + same compile format -> same key, on every host."""
    h = hashlib.sha256()
    for part in (
        COMPILE_FORMAT,
        xgr.get_serialization_version(),
        fingerprint,
        constraint_kind(c),
        constraint_source(c),
    ):
        data = part.encode()
        h.update(len(data).to_bytes(8, "little"))
        h.update(data)
    return h.hexdigest()[:40]


def new_compiler(tok: GrammarTokenizer, threads: int = 1) -> xgr.GrammarCompiler:
    # Redis is the cache; xgrammar's own in-process cache would only duplicate it in memory.
    return xgr.GrammarCompiler(tok.info, max_threads=threads, cache_enabled=False)


def compile_constraint(compiler: xgr.GrammarCompiler, c: Constraint) -> xgr.CompiledGrammar:
    """Compile one constraint; GrammarError naming the problem if it is not valid. Thread-safe
    (xgrammar releases the GIL while compiling)."""
    what = {
        "json_schema": "unsupported or invalid JSON schema",
        "regex": "invalid regex",
        "ebnf": "invalid EBNF grammar",
        "choice": "invalid choices",
    }[constraint_kind(c)]
    try:
        compiled = _compile(compiler, c)
    except GrammarError:
        raise
    except RecursionError:  # a schema nested deeper than Python's stack while rewriting it
        raise GrammarError(f"{what}: nested too deeply") from None
    except Exception as e:  # RuntimeError for every parse / conversion error, or anything else
        raise GrammarError(f"{what}: {compiler_reason(e)}") from None
    if accepts_nothing(compiled):
        raise GrammarError(
            f"{what}: it accepts no output (no token can start one and the empty output is "
            "not allowed; e.g. an empty character class or a rule that only refers to itself)"
        )
    return compiled


def _compile(compiler: xgr.GrammarCompiler, c: Constraint) -> xgr.CompiledGrammar:
    source = constraint_source(c)
    if isinstance(c, JsonSchemaConstraint):
        schema = json.dumps(_parse_json_schema(source))
        ebnf, bounded = json_safe_bounded_strings(
            str(xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True))
        )
        if bounded:
            return compiler.compile_grammar(ebnf, root_rule_name="root")
        return compiler.compile_json_schema(schema, any_whitespace=False, strict_mode=True)
    if isinstance(c, RegexConstraint):
        return compiler.compile_regex(source)
    if isinstance(c, ChoiceConstraint) and not c.choices:
        raise GrammarError("choices must not be empty")
    return compiler.compile_grammar(source, root_rule_name="root")


def accepts_nothing(compiled: xgr.CompiledGrammar) -> bool:
    """No token is allowed at the start, not even a stop token (which an empty output would
    allow): no output can satisfy the grammar, and a request under it could only fail.
    xgrammar compiles such grammars (`[^\\s\\S]`, `root ::= root`, `{"$ref": "#"}`) without
    complaint, so this is checked here, once per compile."""
    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, compiled.tokenizer_info.vocab_size)
    matcher.fill_next_token_bitmask(bitmask)
    return not bool(bitmask.any())


def _parse_json_schema(source: str) -> Any:
    try:
        schema = json.loads(source)
    except json.JSONDecodeError as e:
        raise GrammarError(f"the JSON schema is not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(
            f"a JSON schema must be an object or a boolean, not {type(schema).__name__}"
        )
    return schema


# The character rule xgrammar 0.2.8 writes for a length-bounded string, `[^"\\\r\n]`, and the
# same class without the control characters JSON forbids inside a string.
_BOUNDED_CHARS = re.compile(r'(_characters ::= \(\(\[)\^\\"\\\\\\r\\n(\]\)\))')
_JSON_STRING_CHARS = r'\1^\\0-\\x1f\\"\\\\\2'


def json_safe_bounded_strings(ebnf: str) -> tuple[str, int]:
    """The grammar xgrammar converted from a JSON schema, with its length-bounded strings'
    characters limited to what JSON allows unescaped; and how many such rules were changed.

    xgrammar 0.2.8 gives `{"type": "string", "maxLength": n}` a character class that admits
    raw control characters (mlc-ai/xgrammar#800). Rewriting the schema as the pattern
    `^.{a,b}$` avoided that, but the pattern path costs 8-11 ms per token mask for bounds in
    the hundreds (a tool's 400-800 character argument), against 0.1-0.2 ms for the schema's
    own bounded repetition; so the repetition is kept and only its character class changed.
    Both forms leave escapes out. Remove this (and bump COMPILE_FORMAT) once xgrammar fixes it.
    """
    return _BOUNDED_CHARS.subn(_JSON_STRING_CHARS, ebnf)


_LOG_PREFIX = re.compile(r"^\[[0-9:.]+\] \S+:\d+: ")  # "[12:49:28] /project/cpp/x.cc:83: "
_CHECK_FAILED = re.compile(r"^Check failed: \(.*?\) is false: ")


def compiler_reason(e: BaseException) -> str:
    """xgrammar's message without its C++ log prefix, on one line, at most 1000 characters."""
    text = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(e).strip()))
    text = " ".join(line.strip() for line in text.splitlines() if line.strip())
    return text[:1000] or type(e).__name__


def dump_compiled(compiled: xgr.CompiledGrammar) -> bytes:
    """The cache form: zlib of xgrammar's JSON serialization (about 3x smaller)."""
    return zlib.compress(compiled.serialize_json().encode(), 1)


def load_compiled(data: bytes, tok: GrammarTokenizer) -> xgr.CompiledGrammar:
    """Raises ValueError when the data is corrupt or from another xgrammar format."""
    try:
        return xgr.CompiledGrammar.deserialize_json(zlib.decompress(data).decode(), tok.info)
    except (zlib.error, UnicodeDecodeError, RuntimeError) as e:
        raise ValueError(f"cannot load a compiled grammar: {compiler_reason(e)}") from e
