"""Structured-output constraints as the dialects give them: shapes only (the grammar service
compiles and checks validity)."""

from __future__ import annotations

from typing import Any

import msgspec

from services.gateway.errors import invalid
from services.gateway.protocol import (
    ChatBody,
    CompletionBody,
    JsonObjectFormat,
    JsonSchemaFormat,
    NativeSamplingBody,
    ResponseFormat,
)
from services.gateway.validation.limits import (
    MAX_CHOICES,
    MAX_CONSTRAINT_CHARS,
    SCHEMA_NAME_PATTERN,
)
from services.gateway.validation.sglang_fields import refuse_unsupported
from shared.messages.common import (
    ChoiceConstraint,
    Constraint,
    EbnfConstraint,
    JsonSchemaConstraint,
    RegexConstraint,
)


def response_format_constraint(fmt: ResponseFormat | None) -> Constraint | None:
    """OpenAI `response_format`: text (no constraint), json_object, or json_schema."""
    if isinstance(fmt, JsonObjectFormat):
        return JsonSchemaConstraint(schema='{"type": "object"}', param="response_format")
    if not isinstance(fmt, JsonSchemaFormat):
        return None
    spec, at = fmt.json_schema, "response_format.json_schema"
    if not SCHEMA_NAME_PATTERN.match(spec.name):
        raise invalid(
            f"{at}.name must be 1 to 64 letters, digits, underscores or dashes", f"{at}.name"
        )
    if spec.schema is None:
        raise invalid(f"{at}.schema is required", f"{at}.schema")
    return JsonSchemaConstraint(
        schema=_schema_text(spec.schema, f"{at}.schema"), param=f"{at}.schema"
    )


# A constraint as a request gave it: (the field as the client spelled it, its kind, its value)
Given = tuple[str, str, Any]


def openai_constraint(body: CompletionBody | ChatBody) -> Constraint | None:
    """`response_format`, SGLang's `regex` / `ebnf` (and, on completions, `json_schema`), or
    vLLM's `structured_outputs` and `guided_*`: at most one of them."""
    fmt = response_format_constraint(body.response_format)
    given: list[Given] = [
        ("regex", "regex", body.regex),
        ("ebnf", "ebnf", body.ebnf),
        ("json_schema", "json", body.json_schema if isinstance(body, CompletionBody) else None),
        ("guided_json", "json", body.guided_json),
        ("guided_regex", "regex", body.guided_regex),
        ("guided_choice", "choice", body.guided_choice),
        ("guided_grammar", "ebnf", body.guided_grammar),
    ]
    so = body.structured_outputs
    if so is not None:
        refuse_unsupported(so, "structured_outputs.")
        given += [
            ("structured_outputs.json", "json", so.json),
            ("structured_outputs.regex", "regex", so.regex),
            ("structured_outputs.choice", "choice", so.choice),
            ("structured_outputs.grammar", "ebnf", so.grammar),
            (
                "structured_outputs.json_object",
                "json",
                '{"type": "object"}' if so.json_object else None,
            ),
        ]
    names = ["response_format"] if fmt is not None else []
    _at_most_one(names + [param for param, _, value in given if value is not None])
    return _one_of(given) or fmt


def native_constraint(s: NativeSamplingBody) -> Constraint | None:
    """`sampling_params.json_schema` / `regex` / `ebnf` / `choices`: at most one of them."""
    given: list[Given] = [
        ("sampling_params.json_schema", "json", s.json_schema),
        ("sampling_params.regex", "regex", s.regex),
        ("sampling_params.ebnf", "ebnf", s.ebnf),
        ("sampling_params.choices", "choice", s.choices),
    ]
    _at_most_one([param for param, _, value in given if value is not None])
    return _one_of(given)


def _at_most_one(given: list[str]) -> None:
    if len(given) > 1:
        names = " and ".join(given)
        raise invalid(f"give at most one structured-output constraint; got {names}", given[1])


def _one_of(given: list[Given]) -> Constraint | None:
    """The constraint of the one field given (at most one is), or None."""
    for param, kind, value in given:
        if value is None:
            continue
        if kind == "json":
            return JsonSchemaConstraint(schema=_schema_text(value, param), param=param)
        if kind == "regex":
            return RegexConstraint(pattern=_constraint_text(value, param), param=param)
        if kind == "ebnf":
            return EbnfConstraint(grammar=_constraint_text(value, param), param=param)
        if not value or len(value) > MAX_CHOICES:
            raise invalid(f"{param} must hold 1 to {MAX_CHOICES} strings", param)
        if sum(len(c) for c in value) > MAX_CONSTRAINT_CHARS:
            raise invalid(f"{param} may hold at most {MAX_CONSTRAINT_CHARS} characters", param)
        return ChoiceConstraint(choices=list(value), param=param)
    return None


def _schema_text(schema: str | dict[str, Any], param: str) -> str:
    """A schema object as JSON text (key order kept: it is the order properties are generated
    in); a string is passed on as it is."""
    text = schema if isinstance(schema, str) else msgspec.json.encode(schema).decode()
    return _constraint_text(text, param)


def _constraint_text(text: str, param: str) -> str:
    if not text.strip():
        raise invalid(f"{param} must not be empty", param)
    if len(text) > MAX_CONSTRAINT_CHARS:
        raise invalid(f"{param} may be at most {MAX_CONSTRAINT_CHARS} characters long", param)
    return text
