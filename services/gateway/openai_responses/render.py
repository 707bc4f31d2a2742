"""The Response object and, streamed, the Responses events that build it:

    response.created, response.in_progress
    [reasoning item: output_item.added, reasoning_text.delta..., reasoning_text.done,
     output_item.done]                               (with --reasoning-parser)
    message item: output_item.added, content_part.added, output_text.delta...,
                  output_text.done, content_part.done, output_item.done
    response.completed (or response.incomplete at max_output_tokens)

Every event has its sequence_number; the items' ids are derived from the request's.
"""

from __future__ import annotations

import time
from typing import Any

from services.gateway.openai_responses.protocol import ResponsesBody, TextFormat
from services.gateway.reasoning import ThinkSplitter
from shared.messages.reply import Usage


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


def text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseRenderer:
    def __init__(
        self,
        rid: str,
        model: str,
        body: ResponsesBody,
        reasoning: type[ThinkSplitter] | None = None,
    ) -> None:
        self.id, self.model, self.body = f"resp_{rid}", model, body
        self.msg_id, self.rs_id = f"msg_{rid}", f"rs_{rid}"
        self.created = int(time.time())
        self.reasoning = reasoning
        self.splitter = reasoning() if reasoning is not None else None
        self.seq = 0
        self.reasoning_text = ""  # streamed so far
        self.text = ""
        self.open: str | None = None  # the item being streamed: "reasoning" or "message"

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
            "tools": [],
            "tool_choice": "auto" if b.tool_choice is None else b.tool_choice,
            "parallel_tool_calls": True if b.parallel_tool_calls is None else b.parallel_tool_calls,
            "metadata": b.metadata or {},
            "store": False,  # nothing is kept: see README, Responses API
            "truncation": "disabled",
            "user": b.user,
        }

    def reasoning_item(self, text: str) -> dict[str, Any]:
        return {
            "id": self.rs_id,
            "type": "reasoning",
            "summary": [],
            "content": [{"type": "reasoning_text", "text": text}],
        }

    def message_item(self, text: str, status: str) -> dict[str, Any]:
        content = [text_part(text)] if status != "in_progress" else []
        return {
            "id": self.msg_id,
            "type": "message",
            "role": "assistant",
            "status": status,
            "content": content,
        }

    def final(self, text: str, usage: Usage, finish: str | None) -> dict[str, Any]:
        """The whole Response, from the whole output."""
        reasoning, answer = self.reasoning().split(text) if self.reasoning else ("", text)
        status = "incomplete" if finish == "length" else "completed"
        output = [self.reasoning_item(reasoning)] if reasoning else []
        output.append(self.message_item(answer, status))
        return self.response(status, output, usage, finish)

    # -- streamed events --------------------------------------------------------------------
    def event(self, kind: str, **fields: Any) -> tuple[str, dict[str, Any]]:
        out = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return kind, out

    def head(self) -> list[tuple[str, dict[str, Any]]]:
        progress = self.response("in_progress", [])
        return [
            self.event("response.created", response=progress),
            self.event("response.in_progress", response=progress),
        ]

    def _open(self, item: str) -> list[tuple[str, dict[str, Any]]]:
        events = self._close_reasoning() if item == "message" else []
        self.open = item
        if item == "reasoning":
            added = {"id": self.rs_id, "type": "reasoning", "summary": [], "content": []}
            return [self.event("response.output_item.added", output_index=0, item=added)]
        index = self.message_index
        return [
            *events,
            self.event(
                "response.output_item.added",
                output_index=index,
                item=self.message_item("", "in_progress"),
            ),
            self.event(
                "response.content_part.added",
                item_id=self.msg_id,
                output_index=index,
                content_index=0,
                part=text_part(""),
            ),
        ]

    @property
    def message_index(self) -> int:
        return 1 if self.reasoning_text else 0

    def _close_reasoning(self) -> list[tuple[str, dict[str, Any]]]:
        if self.open != "reasoning":
            return []
        self.open = None
        text = self.reasoning_text
        return [
            self.event(
                "response.reasoning_text.done",
                item_id=self.rs_id,
                output_index=0,
                content_index=0,
                text=text,
            ),
            self.event("response.output_item.done", output_index=0, item=self.reasoning_item(text)),
        ]

    def delta(self, text: str, last: bool) -> list[tuple[str, dict[str, Any]]]:
        """The events of one delta's text (`last`: the output is complete)."""
        reasoning, answer = "", text
        if self.splitter is not None:
            reasoning, answer = self.splitter.feed(text)
            if last:
                more = self.splitter.finish()
                reasoning, answer = reasoning + more[0], answer + more[1]
        events = []
        if reasoning:
            if self.open is None:
                events += self._open("reasoning")
            self.reasoning_text += reasoning
            events.append(
                self.event(
                    "response.reasoning_text.delta",
                    item_id=self.rs_id,
                    output_index=0,
                    content_index=0,
                    delta=reasoning,
                )
            )
        if answer or (last and self.open != "message"):
            if self.open != "message":
                events += self._open("message")
            self.text += answer
            if answer:
                events.append(
                    self.event(
                        "response.output_text.delta",
                        item_id=self.msg_id,
                        output_index=self.message_index,
                        content_index=0,
                        delta=answer,
                        logprobs=[],
                    )
                )
        return events

    def tail(self, usage: Usage, finish: str | None) -> list[tuple[str, dict[str, Any]]]:
        index, text = self.message_index, self.text
        status = "incomplete" if finish == "length" else "completed"
        output = [self.reasoning_item(self.reasoning_text)] if self.reasoning_text else []
        output.append(self.message_item(text, status))
        return [
            self.event(
                "response.output_text.done",
                item_id=self.msg_id,
                output_index=index,
                content_index=0,
                text=text,
                logprobs=[],
            ),
            self.event(
                "response.content_part.done",
                item_id=self.msg_id,
                output_index=index,
                content_index=0,
                part=text_part(text),
            ),
            self.event("response.output_item.done", output_index=index, item=output[-1]),
            self.event(f"response.{status}", response=self.response(status, output, usage, finish)),
        ]
