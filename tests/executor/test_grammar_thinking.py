"""Structured output after the thinking part (TokenizedRequest.think_end_id): the grammar of
a reasoning model's request stays dormant until the model writes `</think>`, and constrains
every token after it, on the tiny random-weight model with the think tokens in its vocabulary.

A seeded request draws from its own random stream, so a constrained request that thinks
first must produce, up to its `</think>`, exactly the tokens of an unconstrained twin with the
same seed: no mask touched them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import msgspec
import pytest
import xgrammar as xgr

from services.executor.engine.admission import Limits, admit
from services.executor.grammar.backend import GrammarBackend
from services.executor.request import Req
from shared.grammar import grammar_key
from shared.messages.common import JsonSchemaConstraint, RegexConstraint
from shared.messages.schedule import TokenizedRequest
from tests.executor.helpers import EOS_ID
from tests.executor.test_engine import Run
from tests.executor.test_engine_grammar import FORCED, Setup, check
from tests.executor.thinking import THINK_END_ID, THINKING_VOCAB_SIZE, write_thinking_model

SCHEMA = JsonSchemaConstraint(schema=json.dumps(FORCED))  # opens with forced '{"color": "'
SEEDS = range(12)
# The marker's logit is raised so that a random model ends its thinking after a few tokens.
END_SOON = {THINK_END_ID: 3.0}


@pytest.fixture(scope="module")
def think_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_thinking_model(tmp_path_factory.mktemp("thinking-engine"), seed=5)


@pytest.fixture(scope="module")
def setup(think_dir: Path) -> Setup:
    return Setup(think_dir)


def thinking(setup: Setup, rid: str, max_new: int, **sp: Any) -> TokenizedRequest:
    """A request constrained by SCHEMA after its thinking part."""
    req = setup.request(rid, SCHEMA, max_new, temperature=1.0, **sp)
    return msgspec.structs.replace(req, think_end_id=THINK_END_ID)


def twin(req: TokenizedRequest, rid: str) -> TokenizedRequest:
    """The same request without a constraint."""
    return msgspec.structs.replace(
        req,
        trace=msgspec.structs.replace(req.trace, rid=rid),
        constraint=None,
        grammar_key="",
        think_end_id=None,
    )


def forbidden_at_start(setup: Setup, token: int) -> bool:
    compiled = setup.compiled[grammar_key(SCHEMA, setup.tok.fingerprint)]
    return not xgr.GrammarMatcher(compiled).accept_token(token)


@pytest.mark.parametrize("overlap", [False, True])
def test_the_grammar_starts_after_the_think_end_token(
    setup: Setup, think_dir: Path, overlap: bool
) -> None:
    reqs = [thinking(setup, f"t{s}", 120, seed=s, logit_bias=END_SOON) for s in SEEDS]
    twins = [twin(r, f"u{s}") for s, r in zip(SEEDS, reqs, strict=True)]
    run = Run(setup.engine(think_dir, overlap=overlap))
    run.go({0: [*reqs, *twins]})
    assert (run.engine.overlapped_steps > 0) == overlap
    ended_thinking = 0
    forbidden_thoughts = 0
    for s in SEEDS:
        t, u = run.tokens[f"t{s}"], run.tokens[f"u{s}"]
        assert f"t{s}" not in run.failed
        if THINK_END_ID not in t:  # thought until EOS or max_tokens: as if unconstrained
            assert t == u and run.finish[f"t{s}"] == run.finish[f"u{s}"]
            continue
        k = t.index(THINK_END_ID)
        # Up to the marker: no mask, no forced text, the twin's very tokens.
        assert t[: k + 1] == u[: k + 1], s
        ended_thinking += 1
        forbidden_thoughts += any(forbidden_at_start(setup, x) for x in t[:k])
        # After it: the grammar, from its forced opening to its end.
        answer = t[k + 1 :]
        assert THINK_END_ID not in answer
        assert setup.text(answer).startswith('{"color": "'), setup.text(answer)
        if run.finish[f"t{s}"] == "stop":
            check(SCHEMA, setup.text(answer))
        else:
            assert run.finish[f"t{s}"] == "length" and len(t) == 120
    assert ended_thinking >= len(SEEDS) // 2, ended_thinking
    # The thinking parts held tokens the grammar would have refused as a first token.
    assert forbidden_thoughts >= 3, forbidden_thoughts
    assert run.engine.grammars.stats.jump_forward_tokens > 0  # type: ignore[union-attr]


@pytest.mark.parametrize("overlap", [False, True])
def test_without_the_field_the_grammar_applies_from_the_first_token(
    setup: Setup, think_dir: Path, overlap: bool
) -> None:
    reqs = [
        setup.request(f"c{s}", SCHEMA, 120, temperature=1.0, seed=s, logit_bias=END_SOON)
        for s in SEEDS
    ]
    run = Run(setup.engine(think_dir, overlap=overlap))
    run.go({0: reqs})
    for s in SEEDS:
        out = run.tokens[f"c{s}"]
        assert THINK_END_ID not in out  # its raised logit is masked like any other token
        assert setup.text(out).startswith('{"color": "')
        assert run.finish[f"c{s}"] == "stop"
        check(SCHEMA, setup.text(out))


def test_a_request_that_never_ends_thinking_ends_as_an_unconstrained_one(
    setup: Setup, think_dir: Path
) -> None:
    # The marker never comes; EOS is raised so that some end on it, the others on max_tokens.
    bias = {THINK_END_ID: -100.0, EOS_ID: 3.0}
    reqs = [thinking(setup, f"t{s}", 24, seed=s, logit_bias=bias) for s in SEEDS]
    twins = [twin(r, f"u{s}") for s, r in zip(SEEDS, reqs, strict=True)]
    run = Run(setup.engine(think_dir, overlap=True))
    run.go({0: [*reqs, *twins]})
    finishes = set()
    for s in SEEDS:
        assert run.tokens[f"t{s}"] == run.tokens[f"u{s}"], s
        assert run.finish[f"t{s}"] == run.finish[f"u{s}"]
        finishes.add(run.finish[f"t{s}"])
    assert finishes == {"stop", "length"}, finishes
    assert run.engine.grammars.stats.masks == 0  # type: ignore[union-attr]


def limits() -> Limits:
    return Limits(kv_slots=4096, vocab_size=THINKING_VOCAB_SIZE, context_length=512)


def test_a_resumed_request_wakes_its_grammar_after_the_marker_it_already_sent(
    setup: Setup, think_dir: Path
) -> None:
    c = RegexConstraint(pattern="(yes|no)!")
    backend = GrammarBackend(setup.tok, setup.compiled.__getitem__)
    base = setup.request("r", c, 40)
    base = msgspec.structs.replace(base, think_end_id=THINK_END_ID)
    thought = [ord("z"), ord("?"), THINK_END_ID]
    # Still thinking when its executor was lost: nothing is fed to the grammar, nothing forced.
    req = admit(msgspec.structs.replace(base, resume_ids=thought[:2]), 1, 0.0, limits(), backend)
    assert isinstance(req, Req) and req.grammar is not None
    assert req.grammar.dormant and req.output_ids == thought[:2] and req.finish is None
    # Past the marker, with "y" of the answer sent: the grammar takes "y", forces "es!", done.
    resumed = msgspec.structs.replace(base, resume_ids=[*thought, ord("y")])
    req = admit(resumed, 2, 0.0, limits(), backend)
    assert isinstance(req, Req) and req.grammar is not None
    assert not req.grammar.dormant and req.grammar.offset == 3
    assert setup.text(req.output_ids[3:]) == "yes!" and req.finish == "stop"
    # A dormant grammar forces nothing at the start either.
    fresh = admit(base, 3, 0.0, limits(), backend)
    assert isinstance(fresh, Req) and fresh.output_ids == []
    plain = admit(setup.request("p", SCHEMA, 40), 4, 0.0, limits(), backend)
    assert isinstance(plain, Req)
    assert setup.text(plain.output_ids) == '{"color": "'  # forced at once without the field


def test_a_resumed_request_continues_its_answer_under_the_grammar(
    setup: Setup, think_dir: Path
) -> None:
    thought = [ord("h"), ord("m"), THINK_END_ID, *map(ord, '{"color": "')]
    reqs = [
        msgspec.structs.replace(thinking(setup, f"r{s}", 120, seed=s), resume_ids=thought)
        for s in range(4)
    ]
    run = Run(setup.engine(think_dir, overlap=True))
    run.go({0: reqs})
    for s in range(4):
        assert run.finish[f"r{s}"] == "stop"
        check(SCHEMA, setup.text(thought[3:] + run.tokens[f"r{s}"]))
