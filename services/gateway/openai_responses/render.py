"""The Response object and, streamed, the Responses events that build it:

    response.created, response.in_progress
    then each output item in turn, closed before the next opens:
    reasoning item:     output_item.added, reasoning_text.delta..., reasoning_text.done,
                        output_item.done                      (with --reasoning-parser)
    message item:       output_item.added, content_part.added, output_text.delta...,
                        output_text.done, content_part.done, output_item.done
    function_call item: output_item.added (arguments ""), function_call_arguments.delta...,
                        function_call_arguments.done, output_item.done   (with tools)
    response.completed (or response.incomplete at max_output_tokens)

The answer is read for function calls as chat completions read it (tool_render.ToolReader);
without a call, there is one message item, if empty. Every event has its sequence_number;
the items' ids are derived from the request's (msg_<rid>, then msg_<rid>_1, ...; rs_, fc_).
The item still open at the end has the response's status; those closed before it completed.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.gateway.openai_responses.protocol import ResponsesBody, TextFormat
from services.gateway.reasoning import ThinkSplitter
from services.gateway.tool_render import ToolReader
from services.gateway.tools import ToolCallParser
from services.gateway.validation.tools import ToolPlan
from shared.messages.reply import Usage

Event = tuple[str, dict[str, Any]]
PREFIXES = {"reasoning": "rs", "message": "msg", "function_call": "fc"}


def usage_body(u: Usage) -> dict[str, Any]:
    return {
        "input_tokens": u.prompt_tokens,
        "input_tokens_details": {"cached_tokens": u.cached_tokens},
        "output_tokens": u.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": u.prompt_tokens + u.completion_tokens,
    }


def format_body(fmt: TextFormat | None) -> dict[str, Any]:
    if fmt is None:
        return {"type": "text"}
    if fmt.type != "json_schema":
        return {"type": fmt.type}
    return {"type": "json_schema", "name": fmt.name, "schema": fmt.schema, "strict": fmt.strict}


def tool_body(tool: dict[str, Any]) -> dict[str, Any]:
    """A request's function tool as a Response lists it."""
    return {
        "type": "function",
        "name": tool.get("name"),
        "description": tool.get("description"),
        "parameters": tool.get("parameters"),
        "strict": tool.get("strict"),
    }


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


@dataclass
class Item:
    """An output item: its kind, id, and text (a message's, a reasoning's, or a call's
    arguments); a function_call has its call_id and name."""

    kind: str
    id: str
    text: str = ""
    call_id: str = ""
    name: str = ""

    def body(self, status: str) -> dict[str, Any]:
        """As output lists it ("in_progress": as output_item.added opens it)."""
        if self.kind == "reasoning":
            content = [{"type": "reasoning_text", "text": self.text}]
            return {
                "id": self.id,
                "type": "reasoning",
                "summary": [],
                "content": content if status != "in_progress" else [],
            }
        if self.kind == "function_call":
            return {
                "id": self.id,
                "type": "function_call",
                "call_id": self.call_id,
                "name": self.name,
                "arguments": self.text if status != "in_progress" else "",
                "status": status,
            }
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": [text_part(self.text)] if status != "in_progress" else [],
        }


class ResponseRenderer:
    def __init__(
        self,
        rid: str,
        model: str,
        body: ResponsesBody,
        reasoning: Callable[[], ThinkSplitter] | None = None,
        tools: ToolPlan | None = None,
        tool_parser: type[ToolCallParser] | None = None,
    ) -> None:
        """`reasoning`: the parser that splits the thinking part from the answer (None: the
        whole output is the answer); `tools`: how the answer is read for function calls."""
        self.id, self.model, self.body, self.rid = f"resp_{rid}", model, body, rid
        self.created = int(time.time())
        self.reasoning = reasoning
        self.splitter = reasoning() if reasoning is not None else None
        self.tools, self.tool_parser = tools, tool_parser
        self.reader = ToolReader(tools, tool_parser) if tools is not None else None
        self.seq = 0
        self.ids: dict[str, int] = {}  # item kind -> how many have an id
        self.items: list[Item] = []  # streamed so far, in output order
        self.open: Item | None = None  # the last of them, while it is being streamed

    def _item(self, kind: str, text: str = "", call_id: str = "", name: str = "") -> Item:
        n = self.ids.get(kind, 0)
        self.ids[kind] = n + 1
        prefix = f"{PREFIXES[kind]}_{self.rid}"
        return Item(kind, prefix if n == 0 else f"{prefix}_{n}", text, call_id, name)

    # -- the Response object ----------------------------------------------------------------
    def response(
        self,
        status: str,
        output: list[dict[str, Any]],
        usage: Usage | None = None,
        finish: str | None = None,
    ) -> dict[str, Any]:
        b = self.body
        fmt = b.text.format if b.text and b.text.format else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "usage": usage_body(usage) if usage is not None else None,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if finish == "length" else None,
            "instructions": b.instructions,
            "max_output_tokens": b.max_output_tokens,
            "temperature": b.temperature,
            "top_p": b.top_p,
            "text": {"format": format_body(fmt)},
            "reasoning": {"effort": b.reasoning.effort if b.reasoning else None, "summary": None},
            "tools": [tool_body(t) for t in b.tools or []],
            "tool_choice": "auto" if b.tool_choice is None else b.tool_choice,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "metadata": b.metadata or {},
            "store": False,  # nothing is kept: see README, Responses API
            "truncation": "disabled",
            "user": b.user,
        }

    @staticmethod
    def output(items: list[Item], status: str) -> list[dict[str, Any]]:
        """The items as output lists them: the last has `status`, the others completed."""
        return [
            item.body(status if i == len(items) - 1 else "completed")
            for i, item in enumerate(items)
        ]

    def final(self, text: str, usage: Usage, finish: str | None) -> dict[str, Any]:
        """The whole Response, from the whole output."""
        reasoning, answer = self.reasoning().split(text) if self.reasoning else ("", text)
        status = "incomplete" if finish == "length" else "completed"
        items = [self._item("reasoning", reasoning)] if reasoning else []
        content: str | None = answer
        calls: list[dict[str, Any]] = []
        if self.tools is not None:
            content, calls = ToolReader(self.tools, self.tool_parser).whole(answer)
        if content is not None:
            items.append(self._item("message", content))
        for call in calls:
            fn = call["function"]
            items.append(self._item("function_call", fn["arguments"], call["id"], fn["name"]))
        return self.response(status, self.output(items, status), usage, finish)

    # -- streamed events --------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> Event:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, out

    def head(self) -> list[Event]:
        progress = self.response("in_progress", [])
        return [
            self.event("response.created", response=progress),
            self.event("response.in_progress", response=progress),
        ]

    @property
    def index(self) -> int:
        """The output_index of the open item."""
        return len(self.items) - 1

    def _open(self, item: Item) -> list[Event]:
        events = self._close("completed")
        self.items.append(item)
        self.open = item
        events.append(
            self.event(
                "response.output_item.added",
                output_index=self.index,
                item=item.body("in_progress"),
            )
        )
        if item.kind == "message":
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=item.id,
                    output_index=self.index,
                    content_index=0,
                    part=text_part(""),
                )
            )
        return events

    def _close(self, status: str) -> list[Event]:
        item, self.open = self.open, None
        if item is None:
            return []
        at = {"item_id": item.id, "output_index": self.index}
        if item.kind == "reasoning":
            events = [
                self.event("response.reasoning_text.done", **at, content_index=0, text=item.text)
            ]
        elif item.kind == "function_call":
            events = [
                self.event("response.function_call_arguments.done", **at, arguments=item.text)
            ]
        else:
            events = [
                self.event(
                    "response.output_text.done",
                    **at,
                    content_index=0,
                    text=item.text,
                    logprobs=[],
                ),
                self.event(
                    "response.content_part.done", **at, content_index=0, part=text_part(item.text)
                ),
            ]
        done = item.body(status)
        events.append(self.event("response.output_item.done", output_index=self.index, item=done))
        return events

    def _add(self, kind: str, text: str) -> list[Event]:
        """`text` for the open item of `kind` (one is opened if need be)."""
        events = []
        if self.open is None or self.open.kind != kind:
            events += self._open(self._item(kind))
        item = self.items[-1]
        item.text += text
        at = {"item_id": item.id, "output_index": self.index}
        if kind == "reasoning":
            events.append(
                self.event("response.reasoning_text.delta", **at, content_index=0, delta=text)
            )
        elif kind == "message":
            events.append(
                self.event(
                    "response.output_text.delta", **at, content_index=0, delta=text, logprobs=[]
                )
            )
        else:
            events.append(self.event("response.function_call_arguments.delta", **at, delta=text))
        return events

    def _call(self, entry: dict[str, Any]) -> list[Event]:
        """One of ToolReader's streamed entries: a call's head (its id, name and maybe all
        of its arguments), or more arguments of the open call."""
        events = []
        fn = entry.get("function") or {}
        if "id" in entry:
            events += self._open(self._item("function_call", "", entry["id"], fn.get("name", "")))
        arguments = fn.get("arguments") or ""
        if arguments:
            events += self._add("function_call", arguments)
        return events

    def delta(self, text: str, last: bool) -> list[Event]:
        """The events of one delta's text (`last`: the output is complete)."""
        reasoning, answer = "", text
        if self.splitter is not None:
            reasoning, answer = self.splitter.feed(text)
            if last:
                more = self.splitter.finish()
                reasoning, answer = reasoning + more[0], answer + more[1]
        events = self._add("reasoning", reasoning) if reasoning else []
        calls: list[dict[str, Any]] = []
        if self.reader is not None and (answer or last):  # (a named call opens on its text)
            answer, calls = self.reader.feed(answer, last)
        if answer:
            events += self._add("message", answer)
        for entry in calls:
            events += self._call(entry)
        if last and all(item.kind == "reasoning" for item in self.items):
            events += self._open(self._item("message"))  # no answer: an empty message
        return events

    def tail(self, usage: Usage, finish: str | None) -> list[Event]:
        status = "incomplete" if finish == "length" else "completed"
        events = self._close(status)
        output = self.output(self.items, status)
        events.append(
            self.event(f"response.{status}", response=self.response(status, output, usage, finish))
        )
        return events
