"""The gateway's spans of a generation, whatever front door it came in by:

    request     the gateway took it -> its handler let go of it (the root of the trace, or a
                child of the client's `traceparent`); every other service's span is its child
      reply     its first token reached the handler -> the last reply went to the client

The request span's attributes carry what the client was answered: token counts (prompt,
completion, cached), the finish reason, or the error status.
"""

from __future__ import annotations

import time
from typing import Any

from shared.messages.reply import Delta, GenerationReply
from shared.tracing import Tracing, span_traceparent


class RequestSpan:
    __slots__ = ("attrs", "replying", "span", "tracing")

    def __init__(
        self, tracing: Tracing, parent: str, started: float, attrs: dict[str, Any]
    ) -> None:
        self.tracing = tracing
        self.span = tracing.start("request", parent, started, attrs, server=True)
        self.replying = 0.0  # when its first token reached the handler
        self.attrs: dict[str, Any] = {}

    @property
    def traceparent(self) -> str:
        """What the request carries on: this span as every other service's parent."""
        return span_traceparent(self.span)

    def seen(self, reply: GenerationReply) -> None:
        if isinstance(reply, Delta):
            if reply.token_ids and not self.replying:
                self.replying = time.time()
            if reply.finish_reason is not None:
                usage = reply.usage
                self.attrs.update(
                    prompt_tokens=usage.prompt_tokens,
                    completion_tokens=usage.completion_tokens,
                    cached_tokens=usage.cached_tokens,
                    finish_reason=reply.finish_reason,
                )
        else:
            self.attrs.update(error_status=reply.error.status, error=reply.error.message)

    def end(self, outcome: str = "") -> None:
        """The handler let go of the request (`outcome`: why, when it had no answer)."""
        now = time.time()
        if self.replying:
            self.tracing.record("reply", self.traceparent, self.replying, now)
        if outcome and "finish_reason" not in self.attrs:
            self.attrs["ended"] = outcome
        self.span.set_attributes(self.attrs)
        self.span.end()
