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


def openai_constraint(body: CompletionBody | ChatBody) -> Constraint | None:
    """`response_format`, or SGLang's `regex` / `ebnf` (and, on completions, `json_schema`)
    beside it: at most one of them."""
    fmt = response_format_constraint(body.response_format)
    json_schema = body.json_schema if isinstance(body, CompletionBody) else None
    given = {
        "response_format": fmt,
        "regex": body.regex,
        "ebnf": body.ebnf,
        "json_schema": json_schema,
    }
    _at_most_one([name for name, value in given.items() if value is not None], "")
    return _sglang_constraint(json_schema, body.regex, body.ebnf, "") or fmt


def native_constraint(s: NativeSamplingBody) -> Constraint | None:
    """`sampling_params.json_schema` / `regex` / `ebnf` / `choices`: at most one of them."""
    given = [
        name for name in ("json_schema", "regex", "ebnf", "choices") if getattr(s, name) is not None
    ]
    if not given:
        return None
    _at_most_one(given, "sampling_params.")
    constraint = _sglang_constraint(s.json_schema, s.regex, s.ebnf, "sampling_params.")
    if constraint is not None:
        return constraint
    param = f"sampling_params.{given[0]}"
    assert s.choices is not None
    if not s.choices or len(s.choices) > MAX_CHOICES:
        raise invalid(f"{param} must hold 1 to {MAX_CHOICES} strings", param)
    if sum(len(c) for c in s.choices) > MAX_CONSTRAINT_CHARS:
        raise invalid(f"{param} may hold at most {MAX_CONSTRAINT_CHARS} characters", param)
    return ChoiceConstraint(choices=list(s.choices), param=param)


def _at_most_one(given: list[str], prefix: str) -> None:
    if len(given) > 1:
        names = " and ".join(prefix + n for n in given)
        raise invalid(
            f"give at most one structured-output constraint; got {names}", prefix + given[1]
        )


def _sglang_constraint(
    json_schema: str | dict[str, Any] | None, regex: str | None, ebnf: str | None, prefix: str
) -> Constraint | None:
    """SGLang's three constraint fields (at most one given), named with `prefix`."""
    if json_schema is not None:
        param = prefix + "json_schema"
        return JsonSchemaConstraint(schema=_schema_text(json_schema, param), param=param)
    if regex is not None:
        param = prefix + "regex"
        return RegexConstraint(pattern=_constraint_text(regex, param), param=param)
    if ebnf is not None:
        param = prefix + "ebnf"
        return EbnfConstraint(grammar=_constraint_text(ebnf, param), param=param)
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
