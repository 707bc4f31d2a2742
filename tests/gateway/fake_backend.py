"""A stand-in for tokenizer -> scheduler -> executor -> detokenizer, for gateway tests.

It reads GenerateRequests from rs:tokenize and answers on the reply stream named in each
request's trace with a script chosen by the prompt's text (see SCRIPTS), and records every
AbortRequest it sees on rs:schedule, ending the aborted request with finish reason "abort" as
the executor would. Its "tokenizer" maps text to its UTF-8 bytes: /tokenize of "hé" is
[104, 195, 169], and /detokenize refuses ids above 255 (a text "silent" gets no answer).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import TypeVar

import redis.asyncio as aioredis

from shared import constants
from shared.bus import GroupConsumer, publish
from shared.messages.common import ErrorInfo
from shared.messages.reply import (
    Delta,
    DetokenizeResult,
    Failure,
    ReplyMessage,
    TokenizeResult,
    Usage,
)
from shared.messages.schedule import ScheduleMessage
from shared.messages.tokenize import (
    AbortRequest,
    ChatPrompt,
    DetokenizeRequest,
    GenerateRequest,
    TextPrompt,
    TokenizeMessage,
    TokenizeRequest,
    TokenPrompt,
)

T = TypeVar("T")
PROMPT_TOKENS = 5
Step = tuple[float, ReplyMessage]  # (seconds to wait first, message)


def delta(
    rid: str,
    text: str,
    ids: list[int],
    n: int,
    finish_reason: str | None = None,
    matched_stop: str | int | None = None,
) -> Delta:
    usage = Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=n, cached_tokens=2)
    return Delta(
        rid=rid,
        text=text,
        token_ids=ids,
        usage=usage,
        finish_reason=finish_reason,
        matched_stop=matched_stop,
    )


def failure(rid: str, status: int, message: str, param: str | None = None) -> Failure:
    kind = "invalid_request_error" if status == 400 else "server_error"
    return Failure(rid=rid, error=ErrorInfo(status=status, message=message, param=param, type=kind))


def hello(rid: str) -> list[Step]:
    """The default answer: an admission delta, then "Hello world!" in three tokens."""
    return [
        (0, delta(rid, "", [], 0)),
        (0, delta(rid, "Hello", [101], 1)),
        (0, delta(rid, " world", [102], 2)),
        (0, delta(rid, "!", [103], 3, finish_reason="stop", matched_stop=2)),
    ]


SCRIPTS: dict[str, Callable[[str], list[Step]]] = {
    "too long": lambda rid: [(0, failure(rid, 400, "prompt is too long", "prompt"))],
    "busy": lambda rid: [(0, failure(rid, 503, "queue is full"))],
    "length": lambda rid: [(0, delta(rid, "abc", [1, 2, 3], 3, finish_reason="length"))],
    "fail mid": lambda rid: [
        (0, delta(rid, "a", [1], 1)),
        (0.05, failure(rid, 503, "executor lost")),
    ],
    "hang": lambda rid: [(0, delta(rid, "", [], 0)), (0, delta(rid, "partial", [7], 1))],
    "silent": lambda rid: [],
    # a tool call in the hermes format, its markers split across deltas (tool_choice auto)
    "weather?": lambda rid: [
        (0, delta(rid, "Let me check. <tool", [1], 1)),
        (0, delta(rid, '_call>\n{"name": "weather", "arguments": ', [2], 2)),
        (0, delta(rid, '{"city": "Paris"}}\n</tool_call>', [3], 3)),
        (0, delta(rid, "", [4], 4, finish_reason="stop")),
    ],
    # what the grammar lets a named function's call be: its arguments (tool_choice named)
    "args": lambda rid: [
        (0, delta(rid, '{"city": ', [1], 1)),
        (0, delta(rid, '"Rome"}', [2], 2, finish_reason="stop")),
    ],
    # ... and tool_choice required's: an array of calls
    "calls": lambda rid: [
        (0, delta(rid, '[{"name": "weather", "arguments": {"city": "Oslo"}}, ', [1], 1)),
        (0, delta(rid, '{"name": "time", "arguments": {}}]', [2], 2, finish_reason="stop")),
    ],
    # ... cut short by max_tokens inside the second call's arguments
    "cut calls": lambda rid: [
        (0, delta(rid, '[{"name": "weather", "arguments": {"city": "Oslo"}}, ', [1], 1)),
        (0, delta(rid, '{"name": "time", "arguments": {"tz": "Eu', [2], 2, finish_reason="length")),
    ],
    # a reasoning model's output, its tags split across deltas (tests of --reasoning-parser)
    "think": lambda rid: [
        (0, delta(rid, "<thi", [1], 1)),
        (0, delta(rid, "nk>Two and two", [2], 2)),
        (0, delta(rid, " make four.</th", [3], 3)),
        (0, delta(rid, "ink>\n\nFour", [4], 4)),
        (0, delta(rid, ".", [5], 5, finish_reason="stop")),
    ],
    "slow": lambda rid: [
        (0.1 * (i > 0), delta(rid, f"t{i}", [i], i + 1, finish_reason="stop" if i == 4 else None))
        for i in range(5)
    ],
}


def byte_tokenizer(call: TokenizeRequest | DetokenizeRequest) -> ReplyMessage | None:
    rid = call.trace.rid
    if isinstance(call, DetokenizeRequest):
        bad = next((i for i, t in enumerate(call.token_ids) if t > 255), None)
        if bad is not None:
            return failure(rid, 400, "outside the vocabulary", f"tokens[{bad}]")
        return DetokenizeResult(rid=rid, text=bytes(call.token_ids).decode(errors="replace"))
    prompt = call.prompt
    text = prompt.text if isinstance(prompt, TextPrompt) else prompt.messages[-1].content
    if text == "silent":
        return None
    return TokenizeResult(rid=rid, token_ids=list(text.encode()), max_model_len=64)


def prompt_key(req: GenerateRequest) -> str:
    p = req.prompt
    if isinstance(p, TextPrompt):
        return p.text
    if isinstance(p, ChatPrompt):
        return p.messages[-1].content
    assert isinstance(p, TokenPrompt)
    return "tokens"


class FakeBackend:
    def __init__(self, r: aioredis.Redis) -> None:
        self.r = r
        self.requests: list[GenerateRequest] = []
        self.aborts: list[AbortRequest] = []
        self._tasks: list[asyncio.Task[None]] = []

    async def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._serve_tokenize()),
            asyncio.create_task(self._watch_schedule()),
        ]

    async def stop(self) -> None:
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await t

    async def _serve_tokenize(self) -> None:
        consumer: GroupConsumer[TokenizeMessage] = GroupConsumer(
            self.r, constants.TOKENIZE_STREAM, constants.TOKENIZE_GROUP, "fake", TokenizeMessage
        )
        await consumer.ensure_group()
        while True:
            entries = await consumer.read(block_ms=50)
            for e in entries:
                if isinstance(e.message, GenerateRequest):
                    self.requests.append(e.message)
                    self._tasks.append(asyncio.create_task(self._answer(e.message)))
                elif isinstance(e.message, TokenizeRequest | DetokenizeRequest):
                    answer = byte_tokenizer(e.message)
                    if answer is not None:
                        await publish(self.r, e.message.trace.reply_to, answer)
            await consumer.ack([e.id for e in entries])

    async def _answer(self, req: GenerateRequest) -> None:
        script = SCRIPTS.get(prompt_key(req), hello)
        for wait, message in script(req.trace.rid):
            await asyncio.sleep(wait)
            await publish(self.r, req.trace.reply_to, message)

    async def _watch_schedule(self) -> None:
        consumer: GroupConsumer[ScheduleMessage] = GroupConsumer(
            self.r, constants.SCHEDULE_STREAM, constants.SCHEDULE_GROUP, "fake", ScheduleMessage
        )
        await consumer.ensure_group()
        while True:
            entries = await consumer.read(block_ms=50)
            for e in entries:
                if isinstance(e.message, AbortRequest):
                    self.aborts.append(e.message)
                    await self._end_aborted(e.message.rid)
            await consumer.ack([e.id for e in entries])

    async def _end_aborted(self, rid: str) -> None:
        req = next((q for q in self.requests if q.trace.rid == rid), None)
        if req is not None:
            await publish(self.r, req.trace.reply_to, delta(rid, "", [], 1, finish_reason="abort"))

    async def wait_for_abort(self, rid: str, timeout: float = 3.0) -> AbortRequest:
        """The abort of the request `rid` (its id on the bus, or the client's name for it)."""
        return await _poll(
            lambda: next((a for a in self.aborts if rid in (a.rid, client_rid(a.rid))), None),
            timeout,
        )

    async def wait_for_request(self, key: str, timeout: float = 3.0) -> GenerateRequest:
        def find() -> GenerateRequest | None:
            return next((q for q in self.requests if prompt_key(q) == key), None)

        return await _poll(find, timeout)


def client_rid(bus_rid: str) -> str:
    """The client's name of a request: a rid it chose travels as "<rid>.<8 hex digits>"
    (shared/request_ids.py); one the gateway made up travels as it is."""
    head, _, tail = bus_rid.rpartition(".")
    return head if head and len(tail) == 8 else bus_rid


async def _poll(find: Callable[[], T | None], timeout: float) -> T:
    loop = asyncio.get_running_loop()
    until = loop.time() + timeout
    while (found := find()) is None:
        if loop.time() > until:
            raise AssertionError(f"nothing found within {timeout}s")
        await asyncio.sleep(0.02)
    return found
