"""Grammar-constrained decoding with the tiny model's tokenizer: masks, acceptance, rollback,
jump-forward, and random-logit "models" whose output always satisfies the constraint."""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import jsonschema
import pytest
import torch
import xgrammar as xgr

from services.executor.grammar.backend import GrammarBackend
from services.executor.grammar.masks import apply_bitmask, apply_bitmask_torch, fill_bitmask
from services.executor.grammar.matcher import GrammarViolation, RequestGrammar
from services.executor.sampling.sampler import SamplingTensors, sample
from services.executor.warmup import warm_masks
from shared.grammar import GrammarTokenizer, compile_constraint, grammar_key, new_compiler
from shared.messages.common import (
    ChoiceConstraint,
    Constraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
)
from shared.model_files import read_vocab_size, resolve_model
from tests.executor.helpers import EOS_ID, TINY_VOCAB_SIZE, write_tiny_model

MODEL_VOCAB = 288  # the model's vocabulary is padded past the tokenizer's 264 ids

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "the blue"]},
    },
    "required": ["name", "age", "ok", "color"],
}
POINTS = {
    "type": "array",
    "items": {
        "type": "object",
        "properties": {
            "x": {"type": "integer", "minimum": -5, "maximum": 5},
            "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 3},
        },
        "required": ["x"],
    },
    "maxItems": 3,
}
EMAIL = r"[a-z]{1,8}@[a-z]{2,6}\.(com|org|net)"
WORDS = r"(the|in|then)( (the|in|then)){0,3}"  # the tokenizer merges " the", "the", "in"
SUMS = """
root ::= expr
expr ::= term (("+" | "-") term)*
term ::= [0-9] | "(" expr ")"
"""
CHOICES = ["the cat", "the dog", "in the box", "naïve", "😀"]


@pytest.fixture(scope="module")
def tok(tmp_path_factory: pytest.TempPathFactory) -> GrammarTokenizer:
    path = write_tiny_model(tmp_path_factory.mktemp("grammar"), vocab_size=MODEL_VOCAB)
    source = resolve_model(str(path))
    assert read_vocab_size(source) == MODEL_VOCAB
    return GrammarTokenizer.load(source)


@dataclass
class Grammars:
    """A GrammarBackend whose compiled grammars come from a dict, as from a GrammarCache."""

    tok: GrammarTokenizer
    compiled: dict[str, xgr.CompiledGrammar] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.compiler = new_compiler(self.tok)
        self.backend = GrammarBackend(self.tok, self.compiled.__getitem__)

    def new(self, c: Constraint) -> RequestGrammar:
        key = grammar_key(c, self.tok.fingerprint)
        if key not in self.compiled:
            self.compiled[key] = compile_constraint(self.compiler, c)
        return self.backend.new_request(key, [EOS_ID])

    def data(self, tokens: list[int]) -> bytes:
        return b"".join(self.backend.vocab.token_bytes[t] for t in tokens if t != EOS_ID)

    def text(self, tokens: list[int]) -> str:
        return self.data(tokens).decode()


@pytest.fixture(scope="module")
def grammars(tok: GrammarTokenizer) -> Grammars:
    return Grammars(tok)


def allowed(bitmask: torch.Tensor, row: int) -> set[int]:
    bits = bitmask[row].tolist()
    return {t for t in range(MODEL_VOCAB) if (bits[t >> 5] >> (t & 31)) & 1}


def accepted_by_xgrammar(g: RequestGrammar) -> set[int]:
    """The oracle: every token a copy of the matcher accepts."""
    return {t for t in range(MODEL_VOCAB) if g.matcher.fork().accept_token(t)}


# --- masks ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("constraint", "prefix"),
    [
        (JsonSchemaConstraint(schema=json.dumps(PERSON)), ""),
        (JsonSchemaConstraint(schema=json.dumps(PERSON)), '{"name": "the'),
        (JsonSchemaConstraint(schema=json.dumps(PERSON)), '{"name": "x", "age": 12'),
        (RegexConstraint(pattern=WORDS), "then"),
        (RegexConstraint(pattern="a+"), "aa"),
        (ChoiceConstraint(choices=CHOICES), "na"),
        (EbnfConstraint(grammar=SUMS), "(1+"),
    ],
)
def test_mask_allows_exactly_what_xgrammar_accepts(
    grammars: Grammars, constraint: Constraint, prefix: str
) -> None:
    g = grammars.new(constraint)
    for t in grammars.tok.tokenizer.encode(prefix, add_special_tokens=False):
        assert not g.accept(t)
    bitmask = grammars.backend.allocate_bitmask(3)
    rows = fill_bitmask([None, g, None], bitmask)
    assert rows == [1]
    want = accepted_by_xgrammar(g)
    assert allowed(bitmask, 1) == want
    assert allowed(bitmask, 0) == set(range(MODEL_VOCAB))  # rows without a grammar untouched
    assert not any(t >= TINY_VOCAB_SIZE for t in want)  # padding ids are never allowed


def test_many_rows_fill_together_exactly(grammars: Grammars) -> None:
    """Several matchers fill their rows in one batched (threaded) call, beside rows without
    a grammar and a grammar whose mask was computed early (complete, a stop may follow)."""
    cases: list[tuple[Constraint, str]] = [
        (JsonSchemaConstraint(schema=json.dumps(PERSON)), '{"name": "the'),
        (RegexConstraint(pattern=WORDS), "then"),
        (RegexConstraint(pattern="a+"), "aa"),  # complete: its mask is cached
        (ChoiceConstraint(choices=CHOICES), "na"),
        (EbnfConstraint(grammar=SUMS), "(1+"),
    ]
    gs: list[RequestGrammar | None] = []
    for c, prefix in cases:
        g = grammars.new(c)
        for t in grammars.tok.tokenizer.encode(prefix, add_special_tokens=False):
            g.accept(t)
        gs += [g, None]
    bitmask = grammars.backend.allocate_bitmask(len(gs))
    assert fill_bitmask(gs, bitmask) == list(range(0, len(gs), 2))
    for i, row in enumerate(gs):
        want = accepted_by_xgrammar(row) if row is not None else set(range(MODEL_VOCAB))
        assert allowed(bitmask, i) == want, i


def test_eos_is_allowed_only_where_the_grammar_accepts(grammars: Grammars) -> None:
    g = grammars.new(RegexConstraint(pattern="a+b?"))
    bitmask = grammars.backend.allocate_bitmask(1)
    fill_bitmask([g], bitmask)
    assert allowed(bitmask, 0) == {ord("a")}
    assert not g.accept(ord("a"))
    fill_bitmask([g], bitmask)
    assert allowed(bitmask, 0) == {ord("a"), ord("b"), EOS_ID}
    assert g.accept(EOS_ID) and g.done  # the stop token ends it


def test_done_when_nothing_but_a_stop_token_may_follow(grammars: Grammars) -> None:
    g = grammars.new(ChoiceConstraint(choices=["yes", "no"]))
    assert [g.accept(t) for t in b"ye"] == [False, False]
    assert g.accept(ord("s")) and g.done  # complete, and only EOS could follow: no EOS step


def test_a_token_outside_the_grammar_is_refused(grammars: Grammars) -> None:
    g = grammars.new(RegexConstraint(pattern="[0-9]+"))
    with pytest.raises(GrammarViolation, match="not allowed"):
        g.accept(ord("x"))
    assert g.accepted == [] and not g.done
    assert not g.accept(ord("7"))


@pytest.mark.parametrize(
    ("backend", "contiguous"),
    [("auto", True), ("auto", False), ("xgrammar", True), ("torch", True), ("triton", True)],
)
def test_apply_bitmask_matches_the_torch_twin(
    grammars: Grammars, backend: str, contiguous: bool
) -> None:
    device = "cuda" if backend == "triton" else "cpu"
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("the Triton backend runs on CUDA (tests/kernels covers it on the CPU)")
    gs = [
        grammars.new(JsonSchemaConstraint(schema=json.dumps(PERSON))),
        None,
        grammars.new(RegexConstraint(pattern=EMAIL)),
        grammars.new(ChoiceConstraint(choices=CHOICES)),
    ]
    bitmask = grammars.backend.allocate_bitmask(8)
    rows = fill_bitmask(gs, bitmask)
    assert rows == [0, 2, 3]
    full = torch.randn(4, MODEL_VOCAB + 16, generator=torch.Generator().manual_seed(0))
    full = full.to(device)
    # A row stride past the vocabulary, or every other column (no kernel takes that).
    logits = full[:, :MODEL_VOCAB] if contiguous else full.repeat(1, 2)[:, ::2][:, :MODEL_VOCAB]
    before = logits.clone().cpu()
    twin = logits.clone()
    apply_bitmask(logits, bitmask, rows, backend=backend)
    apply_bitmask_torch(twin, bitmask, rows)
    assert torch.equal(logits, twin)
    got = logits.cpu()
    for i in range(4):
        ok = allowed(bitmask, i) if i in rows else set(range(MODEL_VOCAB))
        for t in range(MODEL_VOCAB):
            want = before[i, t].item() if t in ok else float("-inf")
            assert got[i, t].item() == want, (i, t)


# --- state: rollback and rebuild -----------------------------------------------------------


def test_rollback_and_rebuild_restore_the_mask(grammars: Grammars) -> None:
    g = grammars.new(JsonSchemaConstraint(schema=json.dumps(PERSON)))
    ids = grammars.tok.tokenizer.encode('{"name": "in the', add_special_tokens=False)
    for t in ids[:5]:
        g.accept(t)
    bitmask = grammars.backend.allocate_bitmask(2)
    fill_bitmask([g], bitmask)
    for t in ids[5:]:
        g.accept(t)
    g.rollback(len(ids) - 5)
    assert g.accepted == ids[:5]
    fill_bitmask([None, g], bitmask)
    assert allowed(bitmask, 1) == allowed(bitmask, 0)
    g.rebuild(ids)
    assert g.accepted == ids
    fresh = grammars.new(JsonSchemaConstraint(schema=json.dumps(PERSON)))
    for t in ids:
        fresh.accept(t)
    fill_bitmask([g, fresh], bitmask)
    assert allowed(bitmask, 0) == allowed(bitmask, 1) == accepted_by_xgrammar(fresh)


# --- random models -------------------------------------------------------------------------

Model = Callable[[bytes], torch.Tensor]  # output text so far -> [1, vocab] logits


def seeded_model(seed: int) -> Model:
    gen = torch.Generator().manual_seed(seed)
    return lambda text: torch.randn(1, MODEL_VOCAB, generator=gen) * 3


def text_model(text: bytes) -> torch.Tensor:
    """Logits that depend only on the text so far, not on how it was tokenized."""
    gen = torch.Generator().manual_seed(zlib.crc32(text))
    return torch.randn(1, MODEL_VOCAB, generator=gen) * 3


@dataclass
class Run:
    tokens: list[int]
    text: str
    passes: int  # forward passes: one per sampled token
    forced: list[tuple[str, list[int]]]  # (jump-forward string, tokens taken for it)
    done: bool


def decode(
    grammars: Grammars,
    constraint: Constraint,
    model: Model,
    *,
    jump_forward: bool,
    temperature: float = 0.0,
    seed: int = 0,
    limit: int = 400,
) -> Run:
    """mask -> sample (the executor's sampler) -> accept, one forward pass per sampled token;
    with jump_forward, forced tokens are appended between passes."""
    g = grammars.new(constraint)
    bitmask = grammars.backend.allocate_bitmask(1)
    params = SamplingTensors.build(
        [SamplingParams(temperature=temperature)], MODEL_VOCAB, torch.device("cpu")
    )
    gen = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    forced: list[tuple[str, list[int]]] = []
    passes = 0

    def jump() -> None:
        text = g.matcher.find_jump_forward_string()
        taken = g.jump_forward(limit - len(tokens))
        if taken:
            forced.append((text, taken))
            tokens.extend(taken)

    if jump_forward:
        jump()
    while not g.done and len(tokens) < limit:
        logits = model(grammars.data(tokens))
        passes += 1
        rows = fill_bitmask([g], bitmask)
        apply_bitmask(logits, bitmask, rows)
        token = int(sample(logits, params, gen)[0])
        tokens.append(token)
        if g.accept(token):
            break
        if jump_forward:
            jump()
    return Run(tokens, grammars.text(tokens), passes, forced, g.done)


def check(constraint: Constraint, text: str) -> None:
    if isinstance(constraint, JsonSchemaConstraint):
        jsonschema.validate(json.loads(text), json.loads(constraint.schema))
    elif isinstance(constraint, RegexConstraint):
        assert re.fullmatch(constraint.pattern, text), text
    elif isinstance(constraint, ChoiceConstraint):
        assert text in constraint.choices
    else:
        assert parse_sum(text) == len(text), text


def parse_sum(s: str, i: int = 0) -> int:
    """The end of the longest `expr` of SUMS starting at i (raises if there is none)."""

    def term(i: int) -> int:
        if s[i].isdigit():
            return i + 1
        assert s[i] == "(", s
        j = parse_sum(s, i + 1)
        assert s[j] == ")", s
        return j + 1

    i = term(i)
    while i < len(s) and s[i] in "+-":
        i = term(i + 1)
    return i


CONSTRAINTS = [
    JsonSchemaConstraint(schema=json.dumps(PERSON)),
    JsonSchemaConstraint(schema=json.dumps(POINTS)),
    RegexConstraint(pattern=EMAIL),
    RegexConstraint(pattern=WORDS),
    RegexConstraint(pattern=r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?"),
    EbnfConstraint(grammar=SUMS),
    ChoiceConstraint(choices=CHOICES),
]


@pytest.mark.parametrize("constraint", CONSTRAINTS, ids=lambda c: type(c).__name__)
@pytest.mark.parametrize("seed", range(4))
def test_random_logits_always_give_valid_output(
    grammars: Grammars, constraint: Constraint, seed: int
) -> None:
    run = decode(
        grammars, constraint, seeded_model(seed), jump_forward=False, temperature=1.0, seed=seed
    )
    assert run.done, f"no end after {len(run.tokens)} tokens: {run.text!r}"
    check(constraint, run.text)


@pytest.mark.parametrize(
    "constraint",
    [*CONSTRAINTS, JsonSchemaConstraint(schema='{"type": "object"}')],
    ids=lambda c: type(c).__name__,
)
def test_jump_forward_saves_passes_and_changes_nothing(
    grammars: Grammars, constraint: Constraint
) -> None:
    plain = decode(grammars, constraint, text_model, jump_forward=False)
    fast = decode(grammars, constraint, text_model, jump_forward=True)
    check(constraint, plain.text)
    assert plain.done and fast.done
    assert fast.text == plain.text
    saved = sum(len(taken) for _, taken in fast.forced)
    assert fast.passes + saved == len(fast.tokens)  # every token: sampled or forced
    assert fast.passes <= plain.passes
    for text, taken in fast.forced:
        got = grammars.text(taken)
        assert text.startswith(got) and got, (text, got)


def test_jump_forward_on_a_json_schema(grammars: Grammars) -> None:
    g = grammars.new(JsonSchemaConstraint(schema=json.dumps(PERSON)))
    saved = grammars.backend.stats.jump_forward_tokens
    first = g.jump_forward(100)
    assert grammars.text(first) == '{"name": "'
    assert first == grammars.tok.tokenizer.encode('{"name": "', add_special_tokens=False)
    for t in b'ab"':
        g.accept(t)
    # The space after the colon is left to decoding: " " starts longer tokens (" the").
    assert grammars.text(g.jump_forward(100)) == ', "age":'
    assert grammars.backend.stats.jump_forward_tokens - saved == len(first) + len(', "age":')
    assert not g.accept(ord(" "))
    assert g.jump_forward(100) == []  # digits are free


def test_jump_forward_decided_while_the_next_token_is_in_flight(grammars: Grammars) -> None:
    """With overlap the step sampling the next token is already launched: the jump takes
    the forced tokens all the same, and that step's mask allows only the first of them."""
    g = grammars.new(JsonSchemaConstraint(schema=json.dumps(PERSON)))
    saved = grammars.backend.stats.jump_forward_tokens
    first = g.jump_forward(100, in_flight=True)
    assert grammars.text(first) == '{"name": "'
    # The first forced token is sampled by the step in flight: only the rest save a pass.
    assert grammars.backend.stats.jump_forward_tokens - saved == len(first) - 1
    bitmask = grammars.backend.allocate_bitmask(2)
    bitmask[1] = -1
    assert fill_bitmask([None, g], bitmask) == [1]
    assert allowed(bitmask, 1) == {first[0]}
    assert fill_bitmask([None, g], bitmask) == [1]  # filling again does not consume it
    assert allowed(bitmask, 1) == {first[0]}
    # Once that token has landed, the next fill is the grammar's own, after the jump.
    g.forced_landed()
    assert fill_bitmask([None, g], bitmask) == [1]
    assert allowed(bitmask, 1) == accepted_by_xgrammar(g)


def test_jump_forward_respects_the_limit(grammars: Grammars) -> None:
    g = grammars.new(JsonSchemaConstraint(schema=json.dumps(PERSON)))
    assert grammars.text(g.jump_forward(3)) == '{"n'
    assert grammars.text(g.jump_forward(100)) == 'ame": "'
    assert g.jump_forward(0) == []


def test_jump_forward_token_boundaries(grammars: Grammars) -> None:
    tokenizer = grammars.tok.tokenizer
    # The previous token would merge with the forced text (" " + "the" is one token " the"):
    # nothing is forced, the mask decides the next token.
    g = grammars.new(RegexConstraint(pattern="x( |y)then"))
    assert grammars.text(g.jump_forward(10)) == "x"
    g.accept(ord(" "))
    refused = grammars.backend.stats.jump_forward_refused
    assert g.jump_forward(10) == []
    assert grammars.backend.stats.jump_forward_refused == refused + 1
    # A last token that longer tokens start with ("i" < "in") is left to decoding, since
    # free text follows it...
    g = grammars.new(RegexConstraint(pattern="abi[a-z]"))
    assert grammars.text(g.jump_forward(10)) == "ab"
    bitmask = grammars.backend.allocate_bitmask(1)
    fill_bitmask([g], bitmask)
    assert allowed(bitmask, 0) == {ord("i"), tokenizer.convert_tokens_to_ids("in")}
    # ...but kept when the grammar ends right after it.
    g = grammars.new(RegexConstraint(pattern="(abi|cd)"))
    g.accept(ord("a"))
    assert grammars.text(g.jump_forward(10)) == "bi"
    assert g.done


def test_forced_strings_are_tokenized_once(
    grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The same forced text after the same token is looked up, not tokenized again: every
    request of a schema meets the same keys and separators."""
    vocab = grammars.backend.vocab
    calls: list[str] = []
    encode = vocab.encode

    def counted(text: str) -> list[int]:
        calls.append(text)
        return encode(text)

    monkeypatch.setattr(vocab, "encode", counted)
    prev = ord("x")
    first = vocab.consistent_tokens(prev, '", "zq":')
    assert grammars.text(first) == '", "zq":' and calls == ['", "zq":', 'x", "zq":']
    assert vocab.consistent_tokens(prev, '", "zq":') == first
    assert len(calls) == 2
    # A merge across the boundary (" " then "the") is refused, and remembered as refused.
    assert vocab.consistent_tokens(ord(" "), "the") == []
    assert vocab.consistent_tokens(ord(" "), "the") == [] and len(calls) == 4


def test_jump_forward_stops_inside_a_character(grammars: Grammars) -> None:
    g = grammars.new(ChoiceConstraint(choices=["é", "è"]))
    assert g.jump_forward(10) == []  # the forced bytes end inside a UTF-8 character


def test_counters(grammars: Grammars) -> None:
    stats = grammars.backend.stats
    before: dict[str, Any] = dict(vars(stats))
    run = decode(grammars, ChoiceConstraint(choices=CHOICES), text_model, jump_forward=True)
    assert stats.requests == before["requests"] + 1
    assert stats.masks == before["masks"] + run.passes
    assert stats.jump_forward_tokens - before["jump_forward_tokens"] == len(run.tokens) - run.passes


def test_mask_warm_up_masks_its_row_only() -> None:
    """The executor's start-up compile of the mask kernel runs the real path (on the CPU
    here: xgrammar's kernel): its all-forbidding row is masked everywhere, the other row not
    at all."""
    logits = warm_masks(MODEL_VOCAB, torch.device("cpu"))
    assert logits.shape == (2, MODEL_VOCAB)
    assert bool((logits[0] == float("-inf")).all())
    assert bool((logits[1] == 0).all())
