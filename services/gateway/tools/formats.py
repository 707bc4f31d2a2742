"""The formats of the families radixserve serves (their chat templates' own tool syntax)."""

from __future__ import annotations

import json
import re
from typing import Any

from services.gateway.tools.base import ParseStep, ToolCall, ToolCallParser, arguments_json


def json_call(obj: Any, args_key: str = "arguments") -> ToolCall | None:
    """{"name": ..., "<args_key>": {...}} as a call (vLLM accepts either key in each)."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    raw = obj.get(args_key, obj.get("parameters", obj.get("arguments", {})))
    arguments = arguments_json(raw)
    return None if arguments is None else ToolCall(obj["name"], arguments)


def json_calls(text: str, args_key: str = "arguments") -> list[ToolCall] | None:
    """One call object, or a list of them."""
    try:
        value = json.loads(text)
    except ValueError:
        return None
    items = value if isinstance(value, list) else [value]
    calls = [json_call(item, args_key) for item in items]
    return None if not calls or any(c is None for c in calls) else calls  # type: ignore[return-value]


class Hermes(ToolCallParser):
    """<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>, one or more."""

    start, end = "<tool_call>", "</tool_call>"

    def parse_call(self, text: str) -> list[ToolCall] | None:
        return json_calls(text.strip())


class Mistral(ToolCallParser):
    """[TOOL_CALLS][{"name": "f", "arguments": {...}}, ...] (v3 tokenizers), or
    [TOOL_CALLS]f[ARGS]{...} repeated (v11); the calls run to the end of the output."""

    start = "[TOOL_CALLS]"

    def parse_call(self, text: str) -> list[ToolCall] | None:
        text = text.strip()
        if text.startswith("["):
            return json_calls(text)
        calls = []
        for part in text.split(self.start):
            name, sep, args = part.partition("[ARGS]")
            arguments = arguments_json(args.strip()) if sep else None
            if not name.strip() or arguments is None:
                return None
            calls.append(ToolCall(name.strip(), arguments))
        return calls


class Llama3Json(ToolCallParser):
    """{"name": "f", "parameters": {...}} as the whole output, after an optional
    <|python_tag|>; several are separated by ";". An output that does not start with one is
    content."""

    start = "<|python_tag|>"

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        super().__init__(tools)
        self.decided = False  # whether the output's first characters were seen
        self.bare = False  # it began with "{": held whole as a call without the tag

    def feed(self, text: str) -> ParseStep:
        if not self.decided:
            text, self.held = self.held + text, ""
            stripped = text.lstrip()
            if not stripped:
                self.held = text
                return ParseStep()
            self.decided = True
            if stripped.startswith("{"):  # a bare call: the whole output is held
                self.in_call, self.bare, self.held = True, True, self.start + text
                return ParseStep()
        return super().feed(text)

    def finish(self) -> ParseStep:
        self.decided = True
        step = super().finish()
        if self.bare and step.content:  # not a call after all: the output as it was written
            step.content = step.content[len(self.start) :]
        return step

    def parse_call(self, text: str) -> list[ToolCall] | None:
        calls = []
        for part in filter(None, (p.strip() for p in text.split(";"))):
            found = json_calls(part, "parameters")
            if found is None:
                return None
            calls += found
        return calls or None


class Qwen3CoderXml(ToolCallParser):
    """<tool_call><function=f><parameter=p>value</parameter>...</function></tool_call>;
    each value is typed by the function's parameter schema (a string stays as written)."""

    start, end = "<tool_call>", "</tool_call>"
    FUNCTION = re.compile(r"<function=([^>\n]+)>(.*?)</function>", re.S)
    PARAMETER = re.compile(r"<parameter=([^>\n]+)>(.*?)</parameter>", re.S)

    def parse_call(self, text: str) -> list[ToolCall] | None:
        functions = self.FUNCTION.findall(text)
        if not functions or self.FUNCTION.sub("", text).strip():
            return None
        calls = []
        for name, body in functions:
            name = name.strip()
            schema = self.tools.get(name, {}).get("parameters", {}).get("properties", {})
            args = {
                key.strip(): self._typed(value.strip("\n"), schema.get(key.strip(), {}))
                for key, value in self.PARAMETER.findall(body)
            }
            calls.append(ToolCall(name, json.dumps(args, ensure_ascii=False)))
        return calls

    @staticmethod
    def _typed(value: str, schema: dict[str, Any]) -> Any:
        if schema.get("type", "string") == "string":
            return value
        try:
            return json.loads(value)
        except ValueError:
            return value
