"""A grammar that fails inside the executor fails its own request only: a matcher that
raises while filling its mask, or a grammar that allows no token at all (compiled here,
past the grammar service's refusal), ends that request with a RequestFailed naming the
cause, and every other request of the batch, constrained or not, finishes normally."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import xgrammar as xgr

from services.executor.grammar.backend import GrammarBackend
from services.executor.grammar.matcher import RequestGrammar
from shared.grammar import grammar_key
from shared.messages.common import Constraint, RegexConstraint
from tests.executor.helpers import write_tiny_model
from tests.executor.test_engine import Run, make_request
from tests.executor.test_engine_grammar import Setup


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("grammar-guard"), "llama", seed=9)


@pytest.fixture(scope="module")
def setup(tiny_dir: Path) -> Setup:
    return Setup(tiny_dir)


class BrokenMatcher:
    """A real matcher whose mask fill raises, as a native matcher error would."""

    def __init__(self, real: xgr.GrammarMatcher) -> None:
        self._real = real

    def fill_next_token_bitmask(self, *args: Any, **kw: Any) -> None:
        raise RuntimeError("matcher state corrupted")

    def __getattr__(self, name: str) -> Any:
        if name == "_handle":  # what xgrammar's batch fill reads of each matcher
            raise RuntimeError("matcher state corrupted")
        return getattr(self._real, name)


class BreakingBackend(GrammarBackend):
    """Requests whose grammar key is in `broken` get a BrokenMatcher."""

    broken: set[str] = set()

    def new_request(self, key: str, stop_token_ids: Any = ()) -> RequestGrammar:
        g = super().new_request(key, stop_token_ids)
        if key in self.broken:
            g.matcher = BrokenMatcher(g.matcher)  # type: ignore[assignment]
        return g


def engine_with(setup: Setup, path: Path, backend: type[GrammarBackend], **kw: Any) -> Any:
    return setup.engine(path, backend=backend, **kw)


REGEX_A = RegexConstraint(pattern="[a-z]{3,6}")
REGEX_B = RegexConstraint(pattern="(yes|no)!")


@pytest.mark.parametrize("overlap", [False, True])
def test_a_matcher_that_raises_fails_its_request_alone(
    setup: Setup, tiny_dir: Path, overlap: bool
) -> None:
    bad_c: Constraint = RegexConstraint(pattern="[0-9]{2,5}")
    bad = setup.request("bad", bad_c, 20, temperature=1.0, seed=1)
    BreakingBackend.broken = {grammar_key(bad_c, setup.tok.fingerprint)}
    good = [
        setup.request("ga", REGEX_A, 20, temperature=1.0, seed=2),
        setup.request("gb", REGEX_B, 20, temperature=1.0, seed=3),
    ]
    free = make_request("free", [9, 10, 11], max_new=12, ignore_eos=True)
    run = Run(engine_with(setup, tiny_dir, BreakingBackend, overlap=overlap))
    run.go({0: [bad, *good, free]})
    assert set(run.failed) == {"bad"}
    error = run.failed["bad"].error
    assert error.status == 500 and "matcher state corrupted" in error.message
    assert run.finish["ga"] == "stop" and run.finish["gb"] == "stop"
    assert len(run.tokens["free"]) == 12


def test_a_grammar_that_allows_nothing_fails_its_request_alone(
    setup: Setup, tiny_dir: Path
) -> None:
    """Compiled straight with xgrammar (the grammar service refuses it): every logit of its
    row is -inf, the sampler takes token 0, and the grammar refuses that token."""
    c = RegexConstraint(pattern="[^\\s\\S]")
    key = grammar_key(c, setup.tok.fingerprint)
    setup.compiled[key] = setup.compiler.compile_regex(c.pattern)
    req = setup.request("empty", c, 10, temperature=1.0, seed=4)
    good = setup.request("ga", REGEX_A, 20, temperature=1.0, seed=2)
    free = make_request("free", [9, 10, 11], max_new=12, ignore_eos=True)
    run = Run(setup.engine(tiny_dir))
    run.go({0: [req, good, free]})
    assert set(run.failed) == {"empty"}
    assert "structured output failed" in run.failed["empty"].error.message
    assert run.finish["ga"] == "stop" and len(run.tokens["free"]) == 12
