"""The response shapes of /v1/completions and /v1/chat/completions, plain and streamed.

One renderer serves a whole request: `choices[i]` is job i (prompt-major when a batch of
prompts each has `n` choices); a request with a single choice uses the same methods with i=0.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from services.gateway.logprob_format import chat_logprobs, completion_logprobs
from services.gateway.reasoning import ThinkSplitter
from services.gateway.responses import Accumulated
from services.gateway.tool_render import ToolReader
from services.gateway.tools import ToolCallParser
from services.gateway.validation.tools import ToolPlan
from shared.messages.reply import Delta, Usage


def usage_body(u: Usage) -> dict[str, Any]:
    return {
        "prompt_tokens": u.prompt_tokens,
        "completion_tokens": u.completion_tokens,
        "total_tokens": u.prompt_tokens + u.completion_tokens,
        "prompt_tokens_details": {"cached_tokens": u.cached_tokens},
    }


class _Base:
    chunk_object = ""  # the "object" of streamed chunks
    body_object = ""

    def __init__(self, id: str, model: str, include_usage: bool, logprobs: bool) -> None:
        self.id, self.model, self.include_usage = id, model, include_usage
        self.logprobs = logprobs  # the client asked for them (best_of may fetch them anyway)
        self.created = int(time.time())
        # vLLM's stream_options.continuous_usage_stats (with include_usage): every chunk of a
        # choice carries that choice's usage so far
        self.continuous_usage = False

    def envelope(self, kind: str, choices: list[Any]) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }

    def chunk(self, choice: dict[str, Any], usage: Usage | None = None) -> dict[str, Any]:
        out = self.envelope(self.chunk_object, [choice])
        if self.include_usage:  # OpenAI: every chunk has "usage": null but the last
            out["usage"] = usage_body(usage) if self.continuous_usage and usage else None
        return out

    def tail(self, usage: Usage) -> list[Any]:
        if not self.include_usage:
            return []
        return [{**self.envelope(self.chunk_object, []), "usage": usage_body(usage)}]

    def body_many(self, accs: list[Accumulated], usage: Usage) -> Any:
        choices = [self.choice_body(i, a) for i, a in enumerate(accs)]
        return {**self.envelope(self.body_object, choices), "usage": usage_body(usage)}

    def choice_body(self, index: int, acc: Accumulated) -> dict[str, Any]:
        raise NotImplementedError


class CompletionRenderer(_Base):
    chunk_object = body_object = "text_completion"

    def __init__(
        self, id: str, model: str, include_usage: bool, logprobs: bool, echo: bool
    ) -> None:
        super().__init__(id, model, include_usage, logprobs)
        self.echo = echo
        self.offsets: dict[int, int] = {}  # choice -> text_offset of its next streamed token

    def _choice(
        self, index: int, text: str, finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def head_many(self, n: int) -> list[Any]:
        return []

    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]:
        text = (d.echo_text or "") + d.text if self.echo else d.text
        entries = (d.prompt_logprobs if self.echo else []) + d.logprobs
        if not text and not entries and d.finish_reason is None:
            return []
        logprobs = None
        if self.logprobs:
            logprobs, self.offsets[index] = completion_logprobs(entries, self.offsets.get(index, 0))
        return [self.chunk(self._choice(index, text, d.finish_reason, logprobs), d.usage)]

    def choice_body(self, index: int, acc: Accumulated) -> dict[str, Any]:
        text = acc.echo_text + acc.text if self.echo else acc.text
        logprobs = None
        if self.logprobs:
            entries = (acc.prompt_logprobs if self.echo else []) + acc.logprobs
            logprobs, _ = completion_logprobs(entries, 0)
        return self._choice(index, text, acc.finish_reason, logprobs)


class ChatRenderer(_Base):
    chunk_object = "chat.completion.chunk"
    body_object = "chat.completion"

    def __init__(
        self,
        id: str,
        model: str,
        include_usage: bool,
        logprobs: bool,
        reasoning: Callable[[], ThinkSplitter] | None = None,
        tools: ToolPlan | None = None,
        tool_parser: type[ToolCallParser] | None = None,
    ) -> None:
        """`reasoning`: the parser that splits the thinking part from the answer (None: the
        whole output is the answer); `tools`: how the answer is read for tool calls."""
        super().__init__(id, model, include_usage, logprobs)
        self.reasoning = reasoning
        self.splitters: dict[int, ThinkSplitter] = {}  # choice -> its streamed output's
        self.tools, self.tool_parser = tools, tool_parser
        self.readers: dict[int, ToolReader] = {}  # choice -> its streamed output's

    def _reader(self, index: int) -> ToolReader | None:
        if self.tools is None:
            return None
        if index not in self.readers:
            self.readers[index] = ToolReader(self.tools, self.tool_parser)
        return self.readers[index]

    def _texts(self, index: int, d: Delta) -> tuple[str, str]:
        """(reasoning, content) of a streamed delta."""
        if self.reasoning is None:
            return "", d.text
        splitter = self.splitters.setdefault(index, self.reasoning())
        reasoning, content = splitter.feed(d.text)
        if d.finish_reason is not None:
            more = splitter.finish()
            reasoning, content = reasoning + more[0], content + more[1]
        return reasoning, content

    def _choice(
        self, index: int, delta: dict[str, str], finish: str | None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}

    def head_many(self, n: int) -> list[Any]:
        role = {"role": "assistant", "content": ""}
        return [self.chunk(self._choice(i, role, None)) for i in range(n)]

    def delta_at(self, index: int, d: Delta, acc: Accumulated) -> list[Any]:
        events = []
        reasoning, content = self._texts(index, d)
        reader = self._reader(index)
        calls: list[dict[str, Any]] = []
        if reader is not None:
            content, calls = reader.feed(content, d.finish_reason is not None)
        if reasoning or content or calls or (self.logprobs and d.logprobs):
            delta: dict[str, Any] = {}
            if reasoning:  # vLLM's newer name beside the one most clients read
                delta["reasoning_content"] = delta["reasoning"] = reasoning
            if content or not (reasoning or calls):
                delta["content"] = content
            if calls:
                delta["tool_calls"] = calls
            logprobs = chat_logprobs(d.logprobs) if self.logprobs else None
            events.append(self.chunk(self._choice(index, delta, None, logprobs), d.usage))
        if d.finish_reason is not None:
            called = reader is not None and reader.calls > 0
            finish = "tool_calls" if called and d.finish_reason == "stop" else d.finish_reason
            events.append(self.chunk(self._choice(index, {}, finish), d.usage))
        return events

    def choice_body(self, index: int, acc: Accumulated) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": acc.text}
        if self.reasoning is not None:
            reasoning, message["content"] = self.reasoning().split(acc.text)
            message["reasoning_content"] = message["reasoning"] = reasoning or None
        finish = acc.finish_reason
        if self.tools is not None:
            message["content"], calls = ToolReader(self.tools, self.tool_parser).whole(
                message["content"]
            )
            if calls:
                message["tool_calls"] = calls
                finish = "tool_calls" if finish == "stop" else finish
        return {
            "index": index,
            "message": message,
            "logprobs": chat_logprobs(acc.logprobs) if self.logprobs else None,
            "finish_reason": finish,
        }
