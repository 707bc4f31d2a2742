"""A protobuf message's set fields as plain Python values, for the gateway's msgspec bodies.

Only fields the client set appear (proto3 `optional` scalars when present, others when not
their zero value), so an unset field takes the body's own default: the gRPC request is then
validated by exactly the code, and refused with exactly the messages, that the HTTP body is.
"""

from __future__ import annotations

from typing import Any

from google.protobuf.descriptor import FieldDescriptor
from google.protobuf.message import Message


def set_fields(message: Message) -> dict[str, Any]:
    """{field name: value} for the fields `message` has set; sub-messages as dicts, repeated
    fields as lists, maps as dicts."""
    out: dict[str, Any] = {}
    for field, value in message.ListFields():
        out[field.name] = _value(field, value)
    return out


def _value(field: FieldDescriptor, value: Any) -> Any:
    if field.message_type is not None and field.message_type.GetOptions().map_entry:
        value_field = field.message_type.fields_by_name["value"]
        if value_field.message_type is None:
            return dict(value)
        return {k: set_fields(v) for k, v in value.items()}
    if field.message_type is not None:
        if _repeated(field):
            return [set_fields(v) for v in value]
        return set_fields(value)
    return list(value) if _repeated(field) else value


def _repeated(field: FieldDescriptor) -> bool:
    # protobuf 6 has both; 7 dropped `label`
    is_repeated = getattr(field, "is_repeated", None)
    if is_repeated is not None:
        return bool(is_repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)
