"""Arrivals, the concurrency cap, and multi-turn conversations, against the fake server."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import numpy as np
import pytest

from loadtest.backends import BACKENDS, Options, flatten
from loadtest.datasets import SEPARATOR, Conversation, Turn, multi_turn_dataset
from loadtest.runner import Client, arrival_times, run
from loadtest.textgen import TextSource
from tests.loadtest.fake_server import FakeServer, Script

StartFake = Callable[[Script], Awaitable[FakeServer]]


def test_poisson_arrivals_have_the_mean_gap_of_the_rate() -> None:
    times = arrival_times(20_000, rate=5.0, seed=0)
    gaps = np.diff(times)
    assert times[0] == 0.0 and bool(np.all(gaps >= 0))
    assert gaps.mean() == pytest.approx(0.2, rel=0.02)
    assert gaps.std() == pytest.approx(0.2, rel=0.03)  # exponential: std == mean
    assert arrival_times(50, 5.0, seed=0) == times[:50]  # a fixed seed repeats them
    assert arrival_times(50, 5.0, seed=1) != times[:50]


def test_infinite_rate_sends_everything_at_once() -> None:
    assert arrival_times(4, math.inf, seed=0) == [0.0] * 4
    with pytest.raises(ValueError):
        arrival_times(4, 0.0, seed=0)


@pytest.fixture
async def session() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        yield s


def client_for(
    session: aiohttp.ClientSession, fake: FakeServer, backend: str, cap: int | None = None
) -> Client:
    b = BACKENDS[backend]()
    return Client(session, fake.url + b.path, b, Options(model="m"), cap, len)


def prompt_text(body: dict[str, Any]) -> str:
    return (
        flatten(body["messages"])
        if "messages" in body
        else str(body.get("prompt", body.get("text")))
    )


def one_turn(n: int) -> list[Conversation]:
    return [Conversation(turns=(Turn(f"prompt {i}", 2, 5),)) for i in range(n)]


async def test_requests_start_at_their_arrival_times(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = await start_fake(Script(first_delay=0.0, gap=0.0))
    arrivals = arrival_times(8, rate=40.0, seed=3)
    done = await run(client_for(session, fake, "openai"), one_turn(8), arrivals)
    sent = sorted(r.start - done.started for r in done.results)
    # The k-th request to start waits for the k-th arrival time, never less (how much more
    # is the machine's business, not the runner's).
    assert all(s >= at - 1e-3 for s, at in zip(sent, arrivals, strict=True)), (sent, arrivals)
    assert sent[-1] >= arrivals[-1] - 1e-3 > 0


async def test_max_concurrency_caps_requests_in_flight(
    start_fake: StartFake, session: aiohttp.ClientSession
) -> None:
    fake = await start_fake(Script(first_delay=0.02, gap=0.005))
    done = await run(client_for(session, fake, "openai", cap=2), one_turn(8), [0.0] * 8)
    assert all(r.ok for r in done.results)
    assert fake.max_in_flight == 2


@pytest.mark.parametrize("backend", ["openai-chat", "openai", "radixserve"])
async def test_multi_turn_sends_each_turn_after_the_last_with_the_real_answers(
    backend: str, start_fake: StartFake, session: aiohttp.ClientSession, source: TextSource
) -> None:
    script = Script(chunks=["An", " answer", "."], first_delay=0.01, gap=0.005)
    fake = await start_fake(script)
    answer = "".join(script.chunks)
    convs = multi_turn_dataset(source, num_conversations=3, num_turns=3, turn_input_len=20,
                               output_len=5)  # fmt: skip
    done = await run(client_for(session, fake, backend), convs, [0.0] * 3)
    assert len(done.results) == 9 and all(r.ok for r in done.results)
    for conv in convs:
        first = conv.turns[0].user
        mine = [s for s in fake.served if prompt_text(s.body).startswith(first)]
        assert len(mine) == 3
        for k, served in enumerate(mine):
            if k > 0:
                assert served.received >= mine[k - 1].finished  # after the previous answer
            if backend == "openai-chat":
                expect = []
                for t in conv.turns[:k]:
                    expect += [
                        {"role": "user", "content": t.user},
                        {"role": "assistant", "content": answer},
                    ]
                expect.append({"role": "user", "content": conv.turns[k].user})
                assert served.body["messages"] == expect
            else:
                prompt = served.body["prompt" if backend == "openai" else "text"]
                parts = [p for t in conv.turns[:k] for p in (t.user, answer)]
                assert prompt == SEPARATOR.join([*parts, conv.turns[k].user])


async def test_a_failed_turn_fails_the_rest_of_its_conversation(
    start_fake: StartFake, session: aiohttp.ClientSession, source: TextSource
) -> None:
    fake = await start_fake(Script(fail_status=500))
    convs = multi_turn_dataset(source, 2, 3, 10, 5)
    done = await run(client_for(session, fake, "openai-chat"), convs, [0.0, 0.0])
    assert len(fake.served) == 2  # only the first turns were sent
    errors = [r.error or "" for r in done.results]
    assert sum(e.startswith("HTTP 500: ") for e in errors) == 2
    assert errors.count("not sent: turn 0 failed") == 4
