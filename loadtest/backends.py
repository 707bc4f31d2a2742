"""Request bodies and streamed-response parsers per backend, and one streaming HTTP call.

`send` posts one request and returns a RequestResult with the arrival time of every chunk that
carried new text: SGLang computes inter-token latency from those gaps, and so do we.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import aiohttp
import msgspec

from loadtest.datasets import SEPARATOR

Message = dict[str, str]


class Usage(NamedTuple):
    """Token counts the server reported; cached_tokens is None when it reported none."""

    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int | None


@dataclass
class RequestResult:
    """One request as the client saw it; times are time.perf_counter() seconds."""

    ok: bool
    start: float
    end: float
    prompt_len: int  # the client's count of the prompt's tokens (a fallback for usage)
    chunk_times: list[float] = field(default_factory=list)  # chunks that carried new text
    text: str = ""
    usage: Usage | None = None
    error: str | None = None
    hops: dict[str, float] | None = None  # the server's per-stage latency of the first token


@dataclass(frozen=True)
class Options:
    """Request settings shared by every backend."""

    model: str
    temperature: float = 0.0
    ignore_eos: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    hop_latency: bool = False  # ask for the first token's per-stage latency (radixserve)


class Backend:
    """An API: where requests go, what they look like, how to read the stream."""

    path = ""

    def body(
        self, messages: list[Message], output_len: int, schema: dict[str, Any] | None, o: Options
    ) -> dict[str, Any]:
        raise NotImplementedError

    def parse(self, event: dict[str, Any], text_so_far: str) -> tuple[str, Usage | None]:
        """The new text in one streamed event, and the usage it reports if any."""
        raise NotImplementedError

    def hops(self, event: dict[str, Any]) -> dict[str, float] | None:
        """The first token's per-stage latency (ms) if the event reports it."""
        return None


def flatten(messages: list[Message]) -> str:
    """A conversation as one completion prompt: each earlier message is a prefix of it."""
    return SEPARATOR.join(m["content"] for m in messages)


def _openai_common(output_len: int, schema: dict[str, Any] | None, o: Options) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": o.model,
        "max_tokens": output_len,
        "temperature": o.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    # With a schema the grammar decides where the output ends; ignore_eos would fight it.
    if o.ignore_eos and schema is None:
        body["ignore_eos"] = True
    if schema is not None:
        body["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "answer", "schema": schema, "strict": True},
        }
    return body


def _openai_usage(event: dict[str, Any]) -> Usage | None:
    u = event.get("usage")
    if not u:
        return None
    details = u.get("prompt_tokens_details") or {}
    return Usage(u["prompt_tokens"], u["completion_tokens"], details.get("cached_tokens"))


class OpenAICompletions(Backend):
    path = "/v1/completions"

    def body(
        self, messages: list[Message], output_len: int, schema: dict[str, Any] | None, o: Options
    ) -> dict[str, Any]:
        return {
            "prompt": flatten(messages),
            **_openai_common(output_len, schema, o),
            **o.extra_body,
        }

    def parse(self, event: dict[str, Any], text_so_far: str) -> tuple[str, Usage | None]:
        choices = event.get("choices") or [{}]
        return choices[0].get("text") or "", _openai_usage(event)


class OpenAIChat(Backend):
    path = "/v1/chat/completions"

    def body(
        self, messages: list[Message], output_len: int, schema: dict[str, Any] | None, o: Options
    ) -> dict[str, Any]:
        return {"messages": messages, **_openai_common(output_len, schema, o), **o.extra_body}

    def parse(self, event: dict[str, Any], text_so_far: str) -> tuple[str, Usage | None]:
        choices = event.get("choices") or [{}]
        delta = choices[0].get("delta") or {}
        return delta.get("content") or "", _openai_usage(event)


class RadixServe(Backend):
    """The native /generate: every event holds the whole text so far and its meta_info."""

    path = "/generate"

    def body(
        self, messages: list[Message], output_len: int, schema: dict[str, Any] | None, o: Options
    ) -> dict[str, Any]:
        params: dict[str, Any] = {"max_new_tokens": output_len, "temperature": o.temperature}
        if o.ignore_eos and schema is None:
            params["ignore_eos"] = True
        if schema is not None:
            params["json_schema"] = json.dumps(schema)  # SGLang takes the schema as a string
        body: dict[str, Any] = {
            "text": flatten(messages),
            "sampling_params": params,
            "stream": True,
        }
        if o.hop_latency:
            body["return_hop_latency"] = True
        return {**body, **o.extra_body}

    def hops(self, event: dict[str, Any]) -> dict[str, float] | None:
        found = (event.get("meta_info") or {}).get("hop_latency_ms")
        return dict(found) if found else None

    def parse(self, event: dict[str, Any], text_so_far: str) -> tuple[str, Usage | None]:
        text = event.get("text") or ""
        meta = event.get("meta_info") or {}
        usage = None
        if "completion_tokens" in meta:
            usage = Usage(
                meta.get("prompt_tokens", 0), meta["completion_tokens"], meta.get("cached_tokens")
            )
        return text[len(text_so_far) :], usage


BACKENDS: dict[str, type[Backend]] = {
    "radixserve": RadixServe,
    "openai": OpenAICompletions,
    "openai-chat": OpenAIChat,
}


# msgspec's decoder: the client parses every event of every stream, and at tens of thousands
# of events a second json.loads alone takes a good share of its one core.
_decode = msgspec.json.Decoder(dict[str, Any]).decode


async def sse_data(resp: aiohttp.ClientResponse) -> AsyncIterator[tuple[float, bytes]]:
    """(arrival time, payload) of each `data:` line. Splits lines by hand: aiohttp's line
    reader refuses lines over 128 KiB, and /generate's cumulative events grow past that."""
    buf = b""
    async for chunk in resp.content.iter_any():
        now = time.perf_counter()
        buf += chunk
        *lines, buf = buf.split(b"\n")
        for line in lines:
            if line.startswith(b"data:"):
                yield now, line[5:].strip()


def _error_of(event: dict[str, Any]) -> str | None:
    if "error" in event:
        err = event["error"]
        return str(err.get("message", err) if isinstance(err, dict) else err)
    if event.get("object") == "error":  # vLLM's shape
        return str(event.get("message", event))
    return None


async def send(
    session: aiohttp.ClientSession,
    url: str,
    backend: Backend,
    body: dict[str, Any],
    prompt_len: int,
) -> RequestResult:
    """Post one streaming request; network and HTTP errors become a failed result."""
    r = RequestResult(ok=False, start=time.perf_counter(), end=0.0, prompt_len=prompt_len)
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                r.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
            else:
                await _read_stream(resp, backend, r)
    except (TimeoutError, aiohttp.ClientError, json.JSONDecodeError) as e:
        r.error = f"{type(e).__name__}: {e}"
    r.end = time.perf_counter()
    r.ok = r.error is None
    return r


async def _read_stream(resp: aiohttp.ClientResponse, backend: Backend, r: RequestResult) -> None:
    async for now, data in sse_data(resp):
        if data == b"[DONE]":
            return
        event = _decode(data)
        r.error = _error_of(event)
        if r.error is not None:
            return
        new_text, usage = backend.parse(event, r.text)
        if new_text:
            r.chunk_times.append(now)
            r.text += new_text
        if usage is not None:
            r.usage = usage
        hops = backend.hops(event)
        if hops is not None:
            r.hops = hops
    r.error = "the stream ended before data: [DONE]"
