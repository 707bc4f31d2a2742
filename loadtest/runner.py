"""Sending a workload: arrival times, the concurrency cap, and turn-by-turn conversations."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp
import grpc
import numpy as np

from loadtest.backends import Backend, Message, Options, RequestResult, send
from loadtest.datasets import Conversation
from loadtest.grpc_backends import GrpcBackend
from loadtest.progress import Progress


def arrival_times(n: int, rate: float, seed: int) -> list[float]:
    """Seconds after the start at which each of n requests is sent: all at 0 for an infinite
    rate, else a Poisson process (exponential gaps of mean 1/rate) from the first at 0."""
    if math.isinf(rate):
        return [0.0] * n
    if rate <= 0:
        raise ValueError(f"the request rate must be positive, got {rate}")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=n)
    gaps[0] = 0.0
    return [float(t) for t in np.cumsum(gaps)]


@dataclass
class Client:
    """Where and how to send: everything a request needs but its content."""

    session: aiohttp.ClientSession
    url: str
    backend: Backend
    options: Options
    max_concurrency: int | None
    count_tokens: Callable[[str], int]  # answers' lengths when the server reports no usage
    channel: grpc.aio.Channel | None = None  # a gRPC backend's, in place of the HTTP URL

    def __post_init__(self) -> None:
        self._slots: contextlib.AbstractAsyncContextManager[Any] = (
            asyncio.Semaphore(self.max_concurrency)
            if self.max_concurrency
            else contextlib.nullcontext()
        )

    async def request(
        self, messages: list[Message], output_len: int, conv: Conversation, prompt_len: int
    ) -> RequestResult:
        body = self.backend.body(messages, output_len, conv.json_schema, self.options)
        async with self._slots:
            if isinstance(self.backend, GrpcBackend):
                assert self.channel is not None, "a gRPC backend needs a channel"
                return await self.backend.call(self.channel, body, prompt_len)
            return await send(self.session, self.url, self.backend, body, prompt_len)


@dataclass
class Run:
    results: list[RequestResult]
    started: float  # perf_counter at the first arrival
    duration_s: float


def initial_messages(conv: Conversation) -> list[Message]:
    system = [{"role": "system", "content": conv.system}] if conv.system is not None else []
    return [*system, *conv.history]


async def converse(
    client: Client, conv: Conversation, on_result: Callable[[RequestResult], None]
) -> None:
    """Send conv's turns in order, each after the previous answer arrived and with it."""
    messages = initial_messages(conv)
    prompt_len = conv.system_len + conv.history_len
    for k, turn in enumerate(conv.turns):
        messages.append({"role": "user", "content": turn.user})
        prompt_len += turn.user_len
        result = await client.request(list(messages), turn.output_len, conv, prompt_len)
        on_result(result)
        if not result.ok:  # later turns need this answer: count them as failed, unsent
            for _ in conv.turns[k + 1 :]:
                now = time.perf_counter()
                on_result(RequestResult(False, now, now, 0, error=f"not sent: turn {k} failed"))
            return
        messages.append({"role": "assistant", "content": result.text})
        answer_len = result.usage.completion_tokens if result.usage else None
        prompt_len += answer_len if answer_len is not None else client.count_tokens(result.text)


async def run(
    client: Client,
    conversations: Sequence[Conversation],
    arrivals: Sequence[float],
    progress: Progress | None = None,
) -> Run:
    """Start each conversation at its arrival time; return when every request is done."""
    results: list[RequestResult] = []

    def on_result(r: RequestResult) -> None:
        results.append(r)
        if progress is not None:
            progress.update(r.ok)

    async def start_at(at: float, conv: Conversation) -> None:
        await asyncio.sleep(max(0.0, started + at - time.perf_counter()))
        await converse(client, conv, on_result)

    started = time.perf_counter()
    await asyncio.gather(*(start_at(t, c) for t, c in zip(arrivals, conversations, strict=True)))
    duration = time.perf_counter() - started
    if progress is not None:
        progress.close()
    return Run(results, started, duration)
