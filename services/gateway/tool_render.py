"""Reading one chat choice's output for tool calls (validation/tools.py's ToolPlan), as
OpenAI renders them: whole, `message.tool_calls`; streamed, `delta.tool_calls` entries (the
first of each call with its index, id, type and name, then its arguments).

    auto       --tool-call-parser's format; each call goes out when it closes
    named      the output is the arguments: the call's head at once, then the text as it comes
    required   the output is a JSON array of calls: they go out when it is complete (cut
               short by max_tokens: the whole calls, then the cut one's name and arguments)
    none       all content
"""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from services.gateway.tools import ToolCall, ToolCallParser
from services.gateway.validation.tools import ToolPlan


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call_body(call: ToolCall, id: str) -> dict[str, Any]:
    return {
        "id": id,
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


def array_calls(text: str) -> list[ToolCall] | None:
    """The calls of `required`'s array (None: cut short, not JSON)."""
    try:
        items = json.loads(text)
    except ValueError:
        return None
    if not isinstance(items, list):
        return None
    return [_item_call(item) for item in items if isinstance(item, dict) and "name" in item]


def _item_call(item: dict[str, Any]) -> ToolCall:
    return ToolCall(str(item["name"]), json.dumps(item.get("arguments", {}), ensure_ascii=False))


# The head of one call in `required`'s array, as its schema orders the keys (name, then
# arguments); what follows it is the arguments' JSON, possibly cut short.
_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*', re.S)


def cut_array_calls(text: str) -> list[ToolCall]:
    """The calls of `required`'s array cut short (max_tokens): every whole call, then the one
    it stopped in if its name is complete, with the arguments as far as they came, as a named
    tool's cut arguments are returned."""
    decoder = json.JSONDecoder()
    s = text.lstrip()
    if not s.startswith("["):
        return []
    calls: list[ToolCall] = []
    i = 1
    while True:
        while i < len(s) and s[i] in " \t\r\n,":
            i += 1
        if i >= len(s) or s[i] == "]":
            return calls
        try:
            item, i = decoder.raw_decode(s, i)
        except ValueError:
            head = _CALL_HEAD.match(s, i)
            if head is not None:
                calls.append(ToolCall(json.loads(head.group(1)), s[head.end() :].rstrip()))
            return calls
        if isinstance(item, dict) and "name" in item:
            calls.append(_item_call(item))


class ToolReader:
    def __init__(self, plan: ToolPlan, parser: type[ToolCallParser] | None) -> None:
        self.plan = plan
        self.parser = parser(plan.tools) if plan.mode == "auto" and parser is not None else None
        self.calls = 0  # calls sent so far
        self.text = ""  # named and required: the output so far
        self.named_id = ""

    # -- whole ------------------------------------------------------------------------------
    def whole(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of the whole output; content None when only calls."""
        mode = self.plan.mode
        calls: list[ToolCall] | None = []
        content = text
        if mode == "auto" and self.parser is not None:
            step = self.parser.parse(text)
            content, calls = step.content, step.calls
        elif mode == "named":
            content, calls = "", [ToolCall(self.plan.name, text)]
        elif mode == "required":
            calls = array_calls(text)
            if calls is None:
                calls = cut_array_calls(text)
            content = "" if calls else text
        found = [call_body(c, call_id()) for c in calls or []]
        return (content or None) if found else content, found

    # -- streamed ---------------------------------------------------------------------------
    def feed(self, text: str, last: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content, delta.tool_calls entries) of one delta's text."""
        mode = self.plan.mode
        if mode == "auto" and self.parser is not None:
            step = self.parser.feed(text)
            if last:
                step += self.parser.finish()
            return step.content, self._entries(step.calls)
        if mode == "named":
            # One entry per call and chunk, as OpenAI sends them: the first carries the id and
            # name with the first arguments, the others the arguments that follow.
            if not self.named_id:
                self.named_id = call_id()
                self.calls = 1
                head = {"name": self.plan.name, "arguments": text}
                return "", [{"index": 0, "id": self.named_id, "type": "function", "function": head}]
            return "", [{"index": 0, "function": {"arguments": text}}] if text else []
        if mode == "required":
            self.text += text
            if not last:
                return "", []
            calls = array_calls(self.text)
            if calls is None:
                calls = cut_array_calls(self.text)
            return ("", self._entries(calls)) if calls else (self.text, [])
        return text, []

    def _entries(self, calls: list[ToolCall]) -> list[dict[str, Any]]:
        out = []
        for call in calls:
            out.append({"index": self.calls, **call_body(call, call_id())})
            self.calls += 1
        return out
