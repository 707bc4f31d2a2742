"""What a program adds to its state: text, a generation, a choice, a role's start or end.

    s += "Question: " + q              # Text
    s += gen("answer", max_tokens=32)  # Gen
    s += select("pick", ["yes", "no"]) # Select
    s += user("hi")                    # RoleBegin("user"), Text("hi"), RoleEnd("user")

Expressions are plain data; the program's state (state.py) executes them in order.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# SGLang's regexes for `gen(dtype=...)`, written anew: what each type's text looks like.
DTYPE_REGEX = {
    "int": r"[-+]?[0-9]+",
    "float": r"[-+]?[0-9]*\.?[0-9]+([eE][-+]?[0-9]+)?",
    "str": r"\"[^\"\n]*\"",
    "bool": r"(True|False)",
}


class Expr:
    """Something a program adds to its state; `a + b` chains them."""

    def __add__(self, other: Any) -> Seq:
        return Seq([self, *_exprs(other)])

    def __radd__(self, other: Any) -> Seq:
        return Seq([*_exprs(other), self])


@dataclass
class Seq(Expr):
    items: list[Expr]

    def __add__(self, other: Any) -> Seq:
        return Seq([*self.items, *_exprs(other)])


@dataclass
class Text(Expr):
    text: str


@dataclass
class Gen(Expr):
    name: str | None
    params: dict[str, Any] = field(default_factory=dict)  # sampling params, SGLang's names
    logprobs: dict[str, Any] = field(default_factory=dict)  # return_logprob and friends


@dataclass
class Select(Expr):
    name: str | None
    choices: list[str]
    temperature: float = 0.0


@dataclass
class RoleBegin(Expr):
    role: str


@dataclass
class RoleEnd(Expr):
    role: str


def _exprs(value: Any) -> list[Expr]:
    if isinstance(value, Seq):
        return list(value.items)
    if isinstance(value, Expr):
        return [value]
    if isinstance(value, str):
        return [Text(value)]
    raise TypeError(f"cannot add {type(value).__name__} to a program: a str or an expression")


def as_exprs(value: Any) -> list[Expr]:
    """The expressions `s += value` adds."""
    return _exprs(value)
