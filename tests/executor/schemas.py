"""JSON schemas for structured-output tests: every construct users rely on, with strings and
arrays bounded so a random-weight model's output ends because the grammar does.

Strings are ASCII by pattern: xgrammar 0.2.8 lets a JSON string take overlong UTF-8 forms
(e.g. E0 82 96), which a random byte-level model does sample and no decoder accepts; real
tokenizers' tokens never spell them.
"""

from __future__ import annotations

from typing import Any

S = {"type": "string", "pattern": "^[A-Za-z0-9 _.,-]{0,6}$"}
INT = {"type": "integer", "minimum": -50, "maximum": 50}
NUM = {"type": "number", "minimum": 0, "maximum": 10}
BOOL = {"type": "boolean"}
COLOR = {"enum": ["red", "green", "blue"]}


def obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SCHEMAS: list[dict[str, Any]] = [
    obj({"name": S}),
    obj({"age": INT}),
    obj({"score": NUM}),
    obj({"ok": BOOL}),
    obj({"color": COLOR}),
    obj({"name": S, "age": INT, "ok": BOOL}),
    obj({"name": S, "nick": S}, required=["name"]),  # an optional field
    obj({"a": INT, "b": INT, "c": INT}, required=["b"]),
    obj({"tags": {"type": "array", "items": S, "minItems": 1, "maxItems": 3}}),
    obj({"nums": {"type": "array", "items": INT, "minItems": 2, "maxItems": 2}}),
    obj({"inner": obj({"x": INT, "y": INT})}),
    obj({"outer": obj({"inner": obj({"leaf": BOOL})})}),
    obj({"points": {"type": "array", "items": obj({"x": INT}), "maxItems": 2}}),
    obj({"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}}),
    obj({"zip": {"type": "string", "pattern": "^[0-9]{5}$"}, "city": S}),
    obj({"level": {"enum": [1, 2, 3]}}),
    obj({"mode": {"enum": ["on", "off", None]}}),
    obj({"kind": {"const": "fixed"}, "value": INT}),
    obj({"value": {"anyOf": [INT, S]}}),
    obj({"n": {"type": "integer", "minimum": 100, "maximum": 999}}),
    obj({"ratio": {"type": "number", "minimum": -1, "maximum": 1}}),
    obj({"empty": {"type": "array", "items": INT, "maxItems": 0}}),
    obj(
        {
            "matrix": {
                "type": "array",
                "maxItems": 2,
                "items": {"type": "array", "items": INT, "maxItems": 2},
            }
        }
    ),
    obj({"note": {"type": ["string", "null"], "pattern": "^[a-z]{0,5}$"}}),
    obj({"user": {"$ref": "#/$defs/user"}}) | {"$defs": {"user": obj({"id": INT, "name": S})}},
    obj({"a": {"$ref": "#/$defs/p"}, "b": {"$ref": "#/$defs/p"}})
    | {"$defs": {"p": obj({"x": INT})}},
    {"type": "array", "items": INT, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": COLOR, "maxItems": 3},
    {"enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 0, "maximum": 1000},
    {"type": "boolean"},
    obj({"id": {"type": "string", "pattern": "^[a-f0-9]{4}-[a-f0-9]{4}$"}, "ok": BOOL}),
    obj(
        {
            "first": S,
            "last": S,
            "age": INT,
            "email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"},
        }
    ),
]
