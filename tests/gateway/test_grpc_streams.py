"""The gRPC services' merged stream of replies lets go of its requests however it ends."""

from __future__ import annotations

import asyncio

from services.gateway.grpc.streams import merged
from services.gateway.validation import Job
from shared.messages.common import SamplingParams
from shared.messages.tokenize import TextPrompt
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import Running


async def test_a_stream_cancelled_twice_releases_its_requests(
    gw: Running, backend: FakeBackend
) -> None:
    """A stream torn down while its requests are being cancelled is cancelled again during
    its clean-up; the requests' reply queues must still go (they count against
    --max-inflight)."""
    router = gw.state.router
    job = Job(
        prompt=TextPrompt(text="hang"), sampling=SamplingParams(max_new_tokens=4), stream=True
    )
    pendings = await gw.state.dispatcher.submit([job], "")
    first = asyncio.Event()

    async def consume() -> None:
        async for _ in merged(pendings):
            first.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(first.wait(), 5)
    assert pendings[0].key in router.queues
    task.cancel()
    await asyncio.sleep(0)  # one turn of the loop: the stream is now in its clean-up
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert pendings[0].key not in router.queues
    await backend.wait_for_abort(pendings[0].key)  # and the request was aborted downstream
