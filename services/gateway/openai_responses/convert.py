"""A Responses body -> the chat job it stands for. Refusals name the Responses field.

Function tools are the chat endpoint's (validation/tools.py), written flat:

    {"type": "function", "name", "description", "parameters", "strict"}
        -> {"type": "function", "function": {"name", "description", "parameters"}}
    tool_choice {"type": "function", "name": f} -> {"type": "function", "function": {"name": f}}

and the input items of a tool loop become the messages the chat template takes: a
`function_call` item joins the assistant message before it as one of its tool_calls (or
starts one), a `function_call_output` item is a tool message answering its call_id.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
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
from services.gateway.validation.limits import MAX_TOKENS_LIMIT

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = ("input_text", "output_text", "text")
ITEM_TYPES = ("message", "function_call", "function_call_output", "reasoning")
TOOL_FIELDS = ("type", "name", "description", "parameters", "strict")
TOOL_CHOICES = 'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}'
ONLY_FUNCTIONS = "only function tools are served"
# A chat field a refusal names -> the Responses field the client wrote
RENAMED = (
    ("max_completion_tokens", "max_output_tokens"),
    ("max_tokens", "max_output_tokens"),
    ("response_format.json_schema", "text.format"),
    ("response_format", "text.format"),
)
NESTED_TOOL = re.compile(r"\b(tools\[\d+\])\.function\.")
MESSAGE_PATH = re.compile(r"^messages\[(\d+)\](?:\.tool_calls\[(\d+)\]\.function)?")


@dataclass
class Conversation:
    """The chat messages of a request, and where each came from in the request (refusals
    about a message name the Responses field)."""

    messages: list[ChatMessageBody] = field(default_factory=list)
    origins: list[str] = field(default_factory=list)  # messages[i] -> "instructions", "input[k]"
    calls: dict[tuple[int, int], str] = field(default_factory=dict)  # (i, j) -> "input[k]"
    names: dict[str, str] = field(default_factory=dict)  # a function_call's call_id -> its name

    def add(self, message: ChatMessageBody, origin: str) -> None:
        self.messages.append(message)
        self.origins.append(origin)

    def where(self, param: str) -> str:
        """The Responses field of a chat message's field (`messages[2].content`...)."""
        found = MESSAGE_PATH.match(param)
        if found is None:
            return param
        i, rest = int(found[1]), param[found.end() :]
        if found[2] is not None:  # an assistant's call: the function_call item's own field
            return self.calls.get((i, int(found[2])), "input") + rest
        if i >= len(self.messages):
            return "input" + rest
        if self.messages[i].role == "tool" and rest == ".content":
            rest = ".output"
        return self.origins[i] + rest


def responses_job(body: ResponsesBody, served_model: str, tool_parser: str = "") -> Job:
    """The request's chat job; `tool_parser`: the server's --tool-call-parser ("": none)."""
    if body.previous_response_id:
        raise invalid(
            "previous_response_id is not supported: this server does not store responses; "
            "send the whole conversation in input",
            "previous_response_id",
        )
    unsupported(bool(body.background), "background")
    unsupported(bool(body.top_logprobs), "top_logprobs")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        # chat takes 0 (the prompt only, as SGLang does); a response has an output
        raise invalid(
            f"max_output_tokens must be between 1 and {MAX_TOKENS_LIMIT}, "
            f"got {body.max_output_tokens}",
            "max_output_tokens",
        )
    tools = chat_tools(body.tools)
    choice = chat_tool_choice(body.tool_choice)
    conversation = input_messages(body)
    chat = ChatBody(
        model=body.model,
        messages=conversation.messages,
        max_completion_tokens=body.max_output_tokens,
        temperature=body.temperature,
        top_p=body.top_p,
        stream=body.stream,
        response_format=text_format(body.text.format if body.text else None),
        tools=tools,
        tool_choice=choice,
        parallel_tool_calls=body.parallel_tool_calls,
        reasoning_effort=body.reasoning.effort if body.reasoning else None,
        chat_template_kwargs=body.chat_template_kwargs,
        top_k=body.top_k,
        min_p=body.min_p,
        repetition_penalty=body.repetition_penalty,
        seed=body.seed,
    )
    try:
        job = chat_job(chat, served_model, tool_parser)
    except ApiError as e:
        raise renamed(e, conversation) from None
    return replace(job, api="responses")  # the services' refusals name Responses fields


def renamed(e: ApiError, conversation: Conversation) -> ApiError:
    param = e.param or ""
    message = e.message
    for chat_name, name in RENAMED:
        if param.startswith(chat_name):
            param = name + param[len(chat_name) :]
            message = message.replace(chat_name, name)
            break
    if NESTED_TOOL.search(param):  # a tool's field: flat in a Responses tool
        param = NESTED_TOOL.sub(r"\1.", param)
        message = NESTED_TOOL.sub(r"\1.", message)
    if param.startswith("messages["):
        where = conversation.where(param)
        message = message.replace(param, where)
        param = where
    return ApiError(e.status, message, param or None, e.type, e.retry_after)


# -- tools --------------------------------------------------------------------------------------
def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools as the chat endpoint takes them (which checks them further)."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        at = f"tools[{i}]"
        kind = tool.get("type")
        if kind != "function":
            raise invalid(
                f"{at}.type {kind!r} is not supported: {ONLY_FUNCTIONS} "
                '({"type": "function", "name": ..., "parameters": ...})',
                f"{at}.type",
            )
        for key in tool:
            if key == "function":
                raise invalid(
                    f"{at}.function is the chat completions shape: a Responses function tool "
                    'is flat, {"type": "function", "name": ..., "parameters": ...}',
                    f"{at}.function",
                )
            if key not in TOOL_FIELDS:
                raise invalid(
                    f"{at}.{key} is not supported: a function tool takes {', '.join(TOOL_FIELDS)}",
                    f"{at}.{key}",
                )
        if tool.get("strict") is not None and not isinstance(tool["strict"], bool):
            raise invalid(f"{at}.strict must be a boolean", f"{at}.strict")
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, str):
        raise invalid(f"{TOOL_CHOICES}; got {choice!r}", "tool_choice")
    kind = choice.get("type")
    if kind != "function":
        raise invalid(
            f"tool_choice.type {kind!r} is not supported: {ONLY_FUNCTIONS}; {TOOL_CHOICES}",
            "tool_choice.type",
        )
    name = choice.get("name")
    if not isinstance(name, str):
        raise invalid(
            'tool_choice.name is required: {"type": "function", "name": ...}', "tool_choice.name"
        )
    return {"type": "function", "function": {"name": name}}


# -- input --------------------------------------------------------------------------------------
def input_messages(body: ResponsesBody) -> Conversation:
    out = Conversation()
    if body.instructions:
        out.add(ChatMessageBody(role="system", content=body.instructions), "instructions")
    if isinstance(body.input, str):
        out.add(ChatMessageBody(role="user", content=body.input), "input")
        return out
    if not body.input:
        raise invalid("input must not be empty", "input")
    for i, item in enumerate(body.input):
        at = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if role not in ROLES:
                raise invalid(
                    f"{at}.role must be one of {', '.join(ROLES)}; got {role!r}", f"{at}.role"
                )
            out.add(ChatMessageBody(role=role, content=item_text(item.get("content"), at)), at)
        elif kind == "function_call":
            function_call(out, item, at)
        elif kind == "function_call_output":
            call_id = item_string(item, "call_id", at)
            if call_id not in out.names:
                raise invalid(
                    f"{at}.call_id {call_id!r} answers no function_call item before it: send "
                    "the whole conversation in input, the call included",
                    f"{at}.call_id",
                )
            text = output_text(item.get("output"), f"{at}.output")
            message = ChatMessageBody(
                role="tool", content=text, tool_call_id=call_id, name=out.names[call_id]
            )
            out.add(message, at)
        elif kind == "reasoning":
            continue  # an earlier turn's reasoning: chat templates leave it out too
        else:
            raise invalid(
                f"{at}.type {kind!r} is not supported: input items are {', '.join(ITEM_TYPES)}",
                f"{at}.type",
            )
    if not out.messages:
        raise invalid("input has no message: reasoning items alone are no conversation", "input")
    return out


def function_call(out: Conversation, item: dict[str, Any], at: str) -> None:
    """An assistant's call: one more of the tool_calls of the assistant message it follows."""
    call_id = item_string(item, "call_id", at)
    name = item_string(item, "name", at)
    arguments = item_string(item, "arguments", at)
    call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}
    last = out.messages[-1] if out.messages else None
    if last is None or last.role != "assistant":
        last = ChatMessageBody(role="assistant", content=None, tool_calls=[])
        out.add(last, at)
    last.tool_calls = [*(last.tool_calls or []), call]
    out.calls[(len(out.messages) - 1, len(last.tool_calls) - 1)] = at
    out.names[call_id] = name


def item_string(item: dict[str, Any], key: str, at: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise invalid(f"{at}.{key} is required and must be a string", f"{at}.{key}")
    return value


def item_text(content: Any, at: str) -> str:
    """A message item's text: a string, or its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid(f"{at}.content must be a string or a list of parts", f"{at}.content")
    return parts_text(content, f"{at}.content")


def output_text(output: Any, at: str) -> str:
    """A function_call_output's output: a string, or its text parts joined by newlines."""
    if isinstance(output, str):
        return output
    if not isinstance(output, list):
        raise invalid(f"{at} must be a string or a list of parts", at)
    return parts_text(output, at)


def parts_text(parts: list[Any], at: str) -> str:
    texts = []
    for j, part in enumerate(parts):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise invalid(
                f"{at}[{j}] must be a text part ({', '.join(TEXT_PARTS)}) with a "
                f"string text; got type {kind!r}: only text input is supported",
                f"{at}[{j}]",
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
