"""The replies of one RPC's requests (a prompt's `n` samples, or one), merged as they come.

Closing the iterator closes every request: one that has not finished is aborted downstream,
which frees its KV slots. That is what happens when the client cancels the RPC (its task is
cancelled inside `next`) or its deadline passes (a 504 from the request's own deadline, which
is the RPC's).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from services.gateway.dispatch import Pending
from services.gateway.errors import ApiError
from shared.messages.reply import Delta, Failure, GenerationReply


async def merged(pendings: list[Pending]) -> AsyncIterator[tuple[int, Delta]]:
    """(index of the request, its next delta) until every request has finished; a Failure or
    a passed deadline raises its ApiError."""
    queue: asyncio.Queue[tuple[int, GenerationReply | ApiError]] = asyncio.Queue()

    async def pump(i: int, p: Pending) -> None:
        try:
            while True:
                message = await p.next()
                await queue.put((i, message))
                if isinstance(message, Failure) or message.finish_reason is not None:
                    return
        except ApiError as e:
            await queue.put((i, e))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(pendings)]
    try:
        left = len(pendings)
        while left:
            i, message = await queue.get()
            if isinstance(message, ApiError):
                raise message
            if isinstance(message, Failure):
                raise ApiError.from_info(message.error)
            if message.finish_reason is not None:
                left -= 1
            yield i, message
    except (asyncio.CancelledError, GeneratorExit):
        for p in pendings:
            p.abort_reason = "client cancelled the RPC"
        raise
    finally:
        for t in tasks:
            t.cancel()
        # Closed before the wait below: a second cancellation (a stream torn down while its
        # requests are being cancelled) interrupts that wait, and would skip the close and
        # leave the requests' reply queues registered.
        for p in pendings:
            p.close()
        await asyncio.gather(*tasks, return_exceptions=True)
