"""The executor's sender: step outputs go out in order, retried through Redis errors."""

from __future__ import annotations

import asyncio
import contextlib

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from services.executor.sender import Outputs, send_in_order


async def test_batches_keep_their_order_across_redis_errors() -> None:
    outbox: asyncio.Queue[Outputs] = asyncio.Queue()
    published: list[Outputs] = []
    failures = {1: 2, 3: 1}  # batch index -> times its publication fails first

    async def publish(outputs: Outputs) -> None:
        index = outputs[0][1]
        if failures.get(index, 0) > 0:
            failures[index] -= 1
            raise RedisConnectionError("Connection refused")
        published.append(outputs)

    for i in range(6):
        outbox.put_nowait([("rs:detok:0", i)])
    sender = asyncio.create_task(send_in_order(outbox, publish))
    await asyncio.wait_for(outbox.join(), 10)  # every batch published, none dropped
    sender.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await sender
    assert [batch[0][1] for batch in published] == [0, 1, 2, 3, 4, 5]
    assert failures == {1: 0, 3: 0}


async def test_an_error_other_than_an_outage_stops_the_sender() -> None:
    outbox: asyncio.Queue[Outputs] = asyncio.Queue()

    async def publish(outputs: Outputs) -> None:
        raise ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value")

    outbox.put_nowait([("rs:detok:0", 0)])
    with pytest.raises(ResponseError):
        await asyncio.wait_for(send_in_order(outbox, publish), 5)
    assert outbox.empty()
