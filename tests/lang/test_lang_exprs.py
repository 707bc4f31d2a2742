"""The language's expressions and arguments are checked when written, before any backend."""

from __future__ import annotations

from typing import Any

import pytest

import radixserve.lang as rl
from radixserve.lang.ir import Gen, RoleBegin, RoleEnd, Select, Seq, Text


def test_adding_builds_the_expressions_in_order() -> None:
    expr = "Q: " + rl.gen("a", max_tokens=3) + "\n"
    assert isinstance(expr, Seq)
    assert [type(e) for e in expr.items] == [Text, Gen, Text]
    assert rl.user("hi").items == [RoleBegin("user"), Text("hi"), RoleEnd("user")]
    gen = rl.gen("x", max_tokens=5, stop=["\n"], temperature=0)
    assert isinstance(gen, Gen) and gen.params == {
        "max_tokens": 5,
        "stop": ["\n"],
        "temperature": 0,
    }
    assert rl.gen("c", choices=["a", "b"]) == Select("c", ["a", "b"], 0.0)
    number = rl.gen_int("n")
    assert isinstance(number, Gen) and number.params == {"dtype": int}


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: rl.gen("x", n=2), "n must be 1"),
        (lambda: rl.gen("x", regex="a", dtype=int), "at most one"),
        (lambda: rl.gen("x", dtype=list), "dtype must be"),
        (lambda: rl.select("x", []), "non-empty"),
        (lambda: rl.select("x", ["a"], temperature=-1), "temperature"),
        (lambda: rl.select("x", ["a"], choices_method="greedy"), "only token_length_normalized"),
        (lambda: rl.image("cat.png"), "text-only"),
    ],
)
def test_bad_expressions_are_refused_where_written(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make()


def test_a_program_needs_a_backend_and_its_own_arguments() -> None:
    @rl.function
    def program(s: Any, q: str) -> None:
        s += q

    with pytest.raises(RuntimeError, match="set_default_backend"):
        program.run("hi")
    with pytest.raises(TypeError, match="not a backend"):
        program.run("hi", backend=object())
    with pytest.raises(ValueError, match="n must be 1"):
        program.run_batch([{"q": "a"}], n=3)
    with pytest.raises(TypeError, match="unknown argument"):
        program.run_batch([{"q": "a"}], colour="red")
    with pytest.raises(TypeError, match="state as its first argument"):
        rl.function(lambda: None)
