"""A Responses body -> the chat job it stands for. Refusals name the Responses field."""

from __future__ import annotations

from typing import Any

from services.gateway.errors import ApiError, invalid
from services.gateway.openai_responses.protocol import ResponsesBody, TextFormat
from services.gateway.protocol import (
    ChatBody,
    ChatMessageBody,
    JsonObjectFormat,
    JsonSchemaFormat,
    JsonSchemaSpec,
    ResponseFormat,
)
from services.gateway.validation.chat import chat_job
from services.gateway.validation.common import Job, unsupported

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
# A chat field a refusal names -> the Responses field the client wrote
RENAMED = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)


def responses_job(body: ResponsesBody, served_model: str) -> Job:
    if body.previous_response_id:
        raise invalid(
            "previous_response_id is not supported: this server does not store responses; "
            "send the whole conversation in input",
            "previous_response_id",
        )
    unsupported(bool(body.background), "background")
    unsupported(bool(body.tools), "tools")
    unsupported(body.tool_choice not in (None, "none", "auto"), "tool_choice")
    unsupported(bool(body.top_logprobs), "top_logprobs")
    messages = input_messages(body)
    chat = ChatBody(
        model=body.model,
        messages=messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        response_format=text_format(body.text.format if body.text else None),
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        chat_template_kwargs=body.chat_template_kwargs,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
    )
    offset = 1 if body.instructions else 0
    try:
        return chat_job(chat, served_model)
    except ApiError as e:
        raise renamed(e, offset) from None


def renamed(e: ApiError, offset: int) -> ApiError:
    param = e.param or ""
    message = e.message
    for chat_name, name in RENAMED:
        if param.startswith(chat_name):
            param = name + param[len(chat_name) :]
            message = message.replace(chat_name, name)
            break
    if param.startswith("messages["):
        index = int(param[len("messages[") : param.index("]")])
        param = f"input[{index - offset}]" + param[param.index("]") + 1 :]
    return ApiError(e.status, message, param or None, e.type, e.retry_after)


def input_messages(body: ResponsesBody) -> list[ChatMessageBody]:
    out = [ChatMessageBody(role="system", content=body.instructions)] if body.instructions else []
    if isinstance(body.input, str):
        return [*out, ChatMessageBody(role="user", content=body.input)]
    if not body.input:
        raise invalid("input must not be empty", "input")
    for i, item in enumerate(body.input):
        at = f"input[{i}]"
        kind = item.get("type", "message")
        if kind != "message":
            raise invalid(
                f"{at}.type {kind!r} is not supported: input items are messages (function "
                "calls need tools, which this server does not take on /v1/responses yet)",
                f"{at}.type",
            )
        role = item.get("role")
        if role not in ROLES:
            raise invalid(
                f"{at}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{at}.role"
            )
        out.append(ChatMessageBody(role=role, content=item_text(item.get("content"), at)))
    return out


def item_text(content: Any, at: str) -> str:
    """A message item's text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{at}.content must be a string or a list of parts", f"{at}.content")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(
                f"{at}.content[{j}] must be a text part ({', '.join(TEXT_PARTS)}) with a "
                f"string text; got type {kind!r}: only text input is supported",
                f"{at}.content[{j}]",
            )
        texts.append(part["text"])
    return "\n".join(texts)


def text_format(f: TextFormat | None) -> ResponseFormat | None:
    if f is None or f.type == "text":
        return None
    if f.type == "json_object":
        return JsonObjectFormat()
    if f.type == "json_schema":
        if not f.name:
            raise invalid(
                "text.format.name is required for a json_schema format", "text.format.name"
            )
        spec = JsonSchemaSpec(
            name=f.name, schema=f.schema, description=f.description, strict=f.strict
        )
        return JsonSchemaFormat(json_schema=spec)
    raise invalid(
        f"text.format.type must be text, json_object or json_schema; got {f.type!r}",
        "text.format.type",
    )
