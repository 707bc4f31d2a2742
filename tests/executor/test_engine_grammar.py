"""Structured output in the engine, on the tiny random-weight model: its choices are
arbitrary, so the grammar alone makes every finished output valid."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import msgspec
import pytest
import xgrammar as xgr

from services.executor.engine.loop import Engine
from services.executor.grammar.backend import GrammarBackend
from shared.grammar import GrammarTokenizer, compile_constraint, grammar_key, new_compiler
from shared.messages.common import (
    ChoiceConstraint,
    Constraint,
    EbnfConstraint,
    HopTimes,
    JsonSchemaConstraint,
    RegexConstraint,
    SamplingParams,
    Trace,
)
from shared.messages.detok import StepOutput, TokenDelta
from shared.messages.schedule import TokenizedRequest
from shared.model_files import resolve_model
from tests.executor.helpers import EOS_ID, write_tiny_model
from tests.executor.schemas import SCHEMAS
from tests.executor.test_engine import Run, make_engine, make_request

REGEXES = [
    r"[a-z]{1,8}@[a-z]{2,6}\.(com|org)",
    r"(0|[1-9][0-9]{0,3})(\.[0-9]{1,2})?",
    r"(yes|no|maybe)!",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
]
SUMS = 'root ::= expr\nexpr ::= term (("+" | "-") term)*\nterm ::= [0-9] | "(" expr ")"\n'
CHOICES = ["alpha", "beta gamma", "délta"]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("grammar-engine"), "llama", seed=9)


class Setup:
    def __init__(self, path: Path) -> None:
        self.tok = GrammarTokenizer.load(resolve_model(str(path)))
        self.compiler = new_compiler(self.tok)
        self.compiled: dict[str, xgr.CompiledGrammar] = {}

    def engine(
        self,
        path: Path,
        jump_forward: bool = True,
        backend: type[GrammarBackend] = GrammarBackend,
        **kw: Any,
    ) -> Engine:
        grammars = backend(self.tok, self.compiled.__getitem__, jump_forward)
        return make_engine(path, grammars=grammars, **kw)

    def request(self, rid: str, c: Constraint, max_new: int, **sp: Any) -> TokenizedRequest:
        key = grammar_key(c, self.tok.fingerprint)
        if key not in self.compiled:
            self.compiled[key] = compile_constraint(self.compiler, c)
        return TokenizedRequest(
            trace=Trace(rid=rid, reply_to="g", deadline=1e12),
            input_ids=[5, 6, 7, 8 + len(rid) % 50],
            sampling=SamplingParams(max_new_tokens=max_new, **sp),
            max_new_tokens=max_new,
            eos_token_ids=[EOS_ID],
            detok_stream="d",
            constraint=c,
            grammar_key=key,
        )

    def text(self, tokens: list[int]) -> str:
        """The output's bytes, strictly UTF-8: the grammar only allows whole characters."""
        pieces = self.tok.info.decoded_vocab
        return b"".join(pieces[t] for t in tokens if t != EOS_ID).decode()


@pytest.fixture(scope="module")
def setup(tiny_dir: Path) -> Setup:
    return Setup(tiny_dir)


def check(c: Constraint, text: str) -> None:
    if isinstance(c, JsonSchemaConstraint):
        jsonschema.validate(json.loads(text), json.loads(c.schema))
    elif isinstance(c, RegexConstraint):
        assert re.fullmatch(c.pattern, text), text
    elif isinstance(c, ChoiceConstraint):
        assert text in c.choices, text
    else:
        assert re.fullmatch(r"[0-9()+\-]+", text) and text.count("(") == text.count(")"), text


@pytest.mark.parametrize("overlap", [False, True])
def test_every_finished_output_satisfies_its_constraint(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    constraints: list[Constraint] = [JsonSchemaConstraint(schema=json.dumps(s)) for s in SCHEMAS]
    constraints += [RegexConstraint(pattern=p) for p in REGEXES]
    constraints += [EbnfConstraint(grammar=SUMS), ChoiceConstraint(choices=CHOICES)]
    assert sum(isinstance(c, JsonSchemaConstraint) for c in constraints) >= 30
    reqs = [
        setup.request(f"c{i}", c, 200, temperature=1.0, seed=i) for i, c in enumerate(constraints)
    ]
    # Batched with unconstrained requests, which must stay unconstrained.
    free = [make_request(f"u{i}", [9, 10, 11], max_new=30, ignore_eos=True) for i in range(4)]
    run = Run(setup.engine(tiny_dir, overlap=overlap))
    run.go({0: [*reqs[:20], *free[:2]], 3: [*reqs[20:], *free[2:]]})
    # With overlap, constrained steps launch before the previous tokens are known too.
    assert (run.engine.overlapped_steps > 0) == overlap
    completed = 0
    for i, c in enumerate(constraints):
        finish = run.finish[f"c{i}"]
        assert finish in ("stop", "length")
        if finish == "stop":
            completed += 1
            check(c, setup.text(run.tokens[f"c{i}"]))
    assert completed >= 0.9 * len(constraints), f"only {completed}/{len(constraints)} completed"
    for i in range(4):
        assert len(run.tokens[f"u{i}"]) == 30 and run.finish[f"u{i}"] == "length"


def test_output_cut_by_max_tokens_says_length(setup: Setup, tiny_dir: Path) -> None:
    c = JsonSchemaConstraint(
        schema=json.dumps({"type": "array", "items": {"type": "integer"}, "minItems": 50})
    )
    run = Run(setup.engine(tiny_dir))
    run.go({0: [setup.request("cut", c, 12, temperature=1.0, seed=1)]})
    assert run.finish["cut"] == "length"
    assert len(run.tokens["cut"]) == 12


# Keys and values with no multi-byte token in the tiny tokenizer (its merges are "Ġt", "he",
# "Ġthe", "in"): every forced character is exactly one token, so masked greedy decoding must
# pick the very tokens jump-forward appends.
FORCED = {
    "type": "object",
    "properties": {
        "color": {"enum": ["red", "blue"]},
        "size": {"type": "integer", "minimum": 1, "maximum": 9},
        "ok": {"type": "boolean"},
        "mode": {"const": "fast-lane"},
    },
    "required": ["color", "size", "ok", "mode"],
}


@pytest.mark.parametrize("overlap", [False, True])
def test_jump_forward_same_output_fewer_forward_passes(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))

    def run(jump: bool) -> tuple[list[int], Run]:
        r = Run(setup.engine(tiny_dir, jump_forward=jump, overlap=overlap))
        r.go({0: [setup.request("j", c, 200, temperature=0.0)]})
        return r.tokens["j"], r

    plain, plain_run = run(False)
    fast, fast_run = run(True)
    plain_steps, fast_steps = len(plain_run.launched), len(fast_run.launched)
    forced = fast_run.engine.grammars.stats.jump_forward_tokens  # type: ignore[union-attr]
    check(c, setup.text(fast))
    assert fast == plain
    assert forced > 10 and fast_steps < plain_steps
    # Every saved step is a forced token (with overlap, plain decoding also spends one step
    # past the end: it was launched before the last token was known).
    assert fast_steps + forced >= plain_steps - overlap
    if overlap:
        # Once decoding has started, forced text never holds back the next step: each is
        # launched before the previous one's tokens reach the host, jump or not.
        for r in (plain_run, fast_run):
            first_decode = [d for d, _ in r.launched].index(True)
            assert all(ovl for _, ovl in r.launched[first_decode + 1 :]), r.launched


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_text_rides_along_with_the_batch(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    """Forced tokens are computed in the same step as everyone else's next token: decoding
    requests never sit out a step while others catch up on forced text."""
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))
    constrained = [setup.request(f"j{i}", c, 200, temperature=1.0, seed=i) for i in range(4)]
    free = [make_request(f"u{i}", [9, 10, 11], max_new=40, ignore_eos=True) for i in range(2)]
    run = Run(setup.engine(tiny_dir, overlap=overlap))
    run.go({0: [*constrained, *free]})
    assert run.engine.grammars.stats.jump_forward_tokens > 20  # type: ignore[union-attr]
    mixed = [i for i, (decode, _) in enumerate(run.launched) if not decode]
    assert len(mixed) > 2, run.launched  # the prefill, then steps that carried forced text
    # One prefill step (it samples the first token), then one step per further token of the
    # unconstrained requests: every step carried them.
    assert len(run.launched) == 1 + 39, run.launched
    for i in range(4):
        if run.finish[f"j{i}"] == "stop":
            check(c, setup.text(run.tokens[f"j{i}"]))


@pytest.mark.parametrize("overlap", [False, True])
def test_few_forced_tokens_wait_for_ordinary_decode_steps(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    """Below `jump_extend_min` forced tokens per request, forced text goes one token per
    decode step (what a CUDA graph replays) instead of making the step an EXTEND; the output
    is the same either way, and a lone request still extends at once."""
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))

    def run(rids: list[str], jump_extend_min: float, n_free: int = 0) -> Run:
        r = Run(setup.engine(tiny_dir, overlap=overlap))
        r.engine.policy.jump_extend_min = jump_extend_min
        free = [make_request(f"u{i}", [9, 10], max_new=80, ignore_eos=True) for i in range(n_free)]
        r.go({0: [*(setup.request(rid, c, 200, temperature=0.0) for rid in rids), *free]})
        return r

    # Two constrained requests among 30 free ones: their forced text (a key and its
    # punctuation, some 12 tokens each) never reaches one token per request.
    rids = ["a", "bb"]
    extend_now, wait = run(rids, 0.0, n_free=30), run(rids, 1.0, n_free=30)
    for rid in rids:
        assert wait.tokens[rid] == extend_now.tokens[rid]
        assert wait.finish[rid] == "stop"
        check(c, setup.text(wait.tokens[rid]))
    assert extend_now.engine.policy.jump_extended_tokens > 10
    assert wait.engine.policy.jump_extended_tokens == 0
    assert all(decode for decode, _ in wait.launched[1:]), wait.launched  # after the prefill
    assert sum(not decode for decode, _ in extend_now.launched) > 2
    # Alone, a request's forced text is always at least one token per running request.
    alone = run(["a"], 1.0)
    assert alone.engine.policy.jump_extended_tokens > 10
    assert alone.tokens["a"] == extend_now.tokens["a"]


@pytest.mark.parametrize("overlap", [False, True])
def test_forced_tokens_ride_along_where_the_step_runs_as_rows(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    """Where a step with forced text runs as decode rows (extend_rows.py: a graph replay on
    a GPU, forced here on the CPU), the text rides along below `jump_extend_min` too; the
    same output, and past the rows' limit the text waits again."""
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))

    def run(rows_max: int) -> Run:
        r = Run(setup.engine(tiny_dir, overlap=overlap))
        r.engine.policy.jump_extend_min = 1.0
        r.engine.runner.rows_max = rows_max  # the policy asks the runner
        free = [make_request(f"u{i}", [9, 10], max_new=80, ignore_eos=True) for i in range(30)]
        r.go({0: [*(setup.request(rid, c, 200, temperature=0.0) for rid in ("a", "bb")), *free]})
        return r

    rows, narrow, wait = run(64), run(31), run(0)
    assert rows.engine.policy.jump_extended_tokens > 10
    assert narrow.engine.policy.jump_extended_tokens == wait.engine.policy.jump_extended_tokens == 0
    for rid in ("a", "bb"):
        assert rows.tokens[rid] == wait.tokens[rid]
        check(c, setup.text(rows.tokens[rid]))


@pytest.mark.parametrize("overlap", [False, True])
def test_first_token_stamps_with_forced_text_at_the_start(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    """A schema's forced opening is output but never sampled: the first-token stamps go to
    the step that samples the first free token."""
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))
    req = setup.request("h", c, 200, temperature=0.0)
    req = msgspec.structs.replace(
        req, trace=msgspec.structs.replace(req.trace, hops=HopTimes(gateway_received=1.0))
    )
    engine = setup.engine(tiny_dir, overlap=overlap)
    engine.submit(req)
    first: TokenDelta | None = None
    while engine.has_work():
        for _, out in engine.step().outputs:
            assert isinstance(out, StepOutput)
            first = first or next((d for d in out.deltas if d.rid == "h"), None)
    assert first is not None and first.hops is not None
    assert setup.text(first.token_ids).startswith('{"color": "')  # forced, then sampled
    h = first.hops
    assert 1.0 < h.executor_inbox <= h.first_launched <= h.first_on_host


@pytest.mark.parametrize("max_new", [1, 3])
def test_text_forced_at_the_start_counts_against_max_tokens(
    setup: Setup, tiny_dir: Path, max_new: int
) -> None:
    """FORCED's output starts with `{"color": "` (several forced tokens): a budget smaller
    than that ends the request there, "length", without sampling a token past it."""
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))
    run = Run(setup.engine(tiny_dir))
    run.go({0: [setup.request("f", c, max_new, temperature=1.0, seed=3)]})
    assert run.finish["f"] == "length"
    assert len(run.tokens["f"]) == max_new
    run.engine.policy.check_integrity()


def test_a_constrained_request_reports_its_cached_prefix(setup: Setup, tiny_dir: Path) -> None:
    """Text forced at the start is output before the request is resident; the prompt tokens
    it finds in the cache still count as cached (usage.prompt_tokens_details)."""
    c = JsonSchemaConstraint(schema=json.dumps(FORCED))
    constrained = setup.request("k", c, 40, temperature=1.0, seed=1)
    engine = setup.engine(tiny_dir)
    plain = make_request("p", list(constrained.input_ids), max_new=2)
    cached: dict[str, int] = {}

    class Cached(Run):
        def on_delta(self, d: TokenDelta) -> None:
            cached[d.rid] = d.cached_tokens

    Cached(engine).go({0: [plain]})
    Cached(engine).go({0: [constrained]})
    assert cached["p"] == 0
    # the whole prompt: the forced text after it is what is computed
    assert cached["k"] == len(constrained.input_ids)
