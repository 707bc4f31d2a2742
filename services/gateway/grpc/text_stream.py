"""GenerateStream: many requests on one bidirectional stream.

Each StreamRequest (a generate or a chat, named by the client's `tag`) is validated and
dispatched the moment it arrives, so it joins the running batch beside the ones already open;
its chunks come back tagged, interleaved with the others' as they are produced. A request that
is refused or fails gets one `error` reply for its tag and the stream goes on. `cancel` with a
tag aborts that request (its KV is freed) and answers it with a CANCELLED error. When the client
half-closes, the stream ends once every open request has finished; when the call is cancelled
or its deadline passes, every open request is aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc

from services.gateway.access_policy import Caller
from services.gateway.errors import ApiError, invalid
from services.gateway.grpc import text_convert as convert
from services.gateway.grpc.codes import message, status_code
from services.gateway.grpc.generation import dispatch, replies
from services.gateway.state import GatewayState
from shared.grpc_api import radixserve_pb2 as pb

CANCELLED = ApiError(499, "cancelled by the client")


def error_reply(tag: str, e: ApiError) -> pb.StreamResponse:
    err = pb.Error(
        code=status_code(e.status).value[0],
        message=message(e),
        param=e.param or "",
        retry_after_s=e.retry_seconds or 0,
    )
    return pb.StreamResponse(tag=tag, error=err)


async def multiplex(
    state: GatewayState,
    context: grpc.aio.ServicerContext,
    who: Caller,
    requests: AsyncIterator[pb.StreamRequest],
) -> AsyncIterator[pb.StreamResponse]:
    out: asyncio.Queue[pb.StreamResponse | None] = asyncio.Queue()
    open_: dict[str, asyncio.Task[None]] = {}  # tag -> the task running that request

    async def run(tag: str, req: pb.StreamRequest) -> None:
        try:
            state.key_budget.acquire(who.owner)
            try:
                if req.WhichOneof("request") == "generate":
                    jobs = convert.generate_jobs(req.generate, stream=True)
                    param = "generate.text"
                else:
                    jobs = convert.chat_jobs(req.chat, stream=True)
                    param = "chat.messages"
                pendings = await dispatch(state, context, who, jobs, param)
                async for i, d, acc in replies(pendings):
                    chunk = convert.chunk(i, pendings[i].rid, d, acc)
                    out.put_nowait(pb.StreamResponse(tag=tag, chunk=chunk))
            finally:
                state.key_budget.release(who.owner)
        except ApiError as e:
            out.put_nowait(error_reply(tag, e))
        except asyncio.CancelledError:
            out.put_nowait(error_reply(tag, CANCELLED))  # closing its requests aborted them
        finally:
            if open_.get(tag) is asyncio.current_task():
                del open_[tag]

    async def read_all() -> None:
        try:
            async for req in requests:
                tag, kind = req.tag, req.WhichOneof("request")
                if kind == "cancel":
                    task = open_.get(tag)
                    if task is not None:
                        task.cancel()
                    continue
                if kind is None:
                    refusal = invalid("set one of generate, chat and cancel", "request")
                    out.put_nowait(error_reply(tag, refusal))
                elif tag in open_:
                    refusal = invalid(f"tag {tag!r} is already open on this stream", "tag")
                    out.put_nowait(error_reply(tag, refusal))
                else:
                    open_[tag] = asyncio.create_task(run(tag, req), name=f"grpc-stream-{tag}")
        finally:
            # The client half-closed (or the call ended): the open requests finish first.
            await asyncio.gather(*open_.values(), return_exceptions=True)
            out.put_nowait(None)

    reader = asyncio.create_task(read_all(), name="grpc-stream-reader")
    try:
        while (reply := await out.get()) is not None:
            yield reply
        await reader  # its error, if reading the client's messages failed
    finally:
        reader.cancel()
        for task in list(open_.values()):
            task.cancel()
        await asyncio.gather(reader, *open_.values(), return_exceptions=True)
