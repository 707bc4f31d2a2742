"""The gateway's gRPC server against the scripted fake backend, with grpcio's asyncio client:
every refusal is the HTTP one as a gRPC status (field and retry hint in trailers), the client's
deadline and cancellation abort the request downstream, and the bidirectional stream keeps
going past one request's failure."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import pytest
from google.protobuf.struct_pb2 import Struct
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from services.gateway.access_policy import AccessPolicy
from services.gateway.grpc.server import GrpcServer
from services.gateway.state import GatewayState
from shared.grpc_api import radixserve_pb2 as pb
from shared.grpc_api import radixserve_pb2_grpc as pb_grpc
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import Running, wait_until

pytestmark = pytest.mark.redis

Start = Callable[..., Awaitable[tuple[Running, grpc.aio.Channel]]]


@pytest.fixture
async def start_grpc(start_gateway: Callable[..., Awaitable[Running]]) -> AsyncIterator[Start]:
    servers: list[GrpcServer] = []
    channels: list[grpc.aio.Channel] = []

    async def start(**gateway: Any) -> tuple[Running, grpc.aio.Channel]:
        gw = await start_gateway(**gateway)
        server = GrpcServer(gw.state, "127.0.0.1", 0, drain_timeout_s=1.0)
        port = await server.start()
        servers.append(server)
        channels.append(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        return gw, channels[-1]

    yield start
    for ch in channels:
        await ch.close()
    for s in servers:
        await s.stop()


@pytest.fixture
async def text(start_grpc: Start) -> tuple[Running, pb_grpc.RadixServeStub]:
    gw, ch = await start_grpc()
    return gw, pb_grpc.RadixServeStub(ch)


def trailers(e: grpc.aio.AioRpcError) -> dict[str, str]:
    return {k: v for k, v in (e.trailing_metadata() or ())}


async def test_generate_and_stream_render_the_backend_replies(
    text: tuple[Running, pb_grpc.RadixServeStub], backend: FakeBackend
) -> None:
    _, stub = text
    whole = await stub.Generate(pb.GenerateRequest(text="hi", rid="mine"))
    (choice,) = whole.choices
    assert (choice.text, list(choice.output_ids), choice.rid) == (
        "Hello world!",
        [101, 102, 103],
        "mine",
    )
    assert choice.finish.reason == "stop" and choice.finish.matched_token_id == 2
    assert (choice.usage.prompt_tokens, choice.usage.completion_tokens) == (5, 3)
    chunks = [c async for c in stub.StreamGenerate(pb.GenerateRequest(text="hi"))]
    assert [c.text for c in chunks if c.text] == ["Hello", " world", "!"]
    assert chunks[-1].finish.reason == "stop" and not chunks[0].HasField("finish")
    (req, _) = backend.requests
    assert req.api == "native"  # refusals downstream name /generate's fields


@pytest.mark.parametrize(
    ("prompt", "code", "param"),
    [
        ("too long", grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        ("busy", grpc.StatusCode.UNAVAILABLE, None),
    ],
)
async def test_a_downstream_failure_is_its_status(
    text: tuple[Running, pb_grpc.RadixServeStub],
    prompt: str,
    code: grpc.StatusCode,
    param: str | None,
) -> None:
    _, stub = text
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text=prompt))
    assert e.value.code() == code
    assert trailers(e.value).get("error-param") == param


async def test_a_failure_mid_stream_ends_it_with_its_status(
    text: tuple[Running, pb_grpc.RadixServeStub],
) -> None:
    _, stub = text
    seen = []
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for c in stub.StreamGenerate(pb.GenerateRequest(text="fail mid")):
            seen.append(c.text)
    assert seen == ["a"] and e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "executor lost" in (e.value.details() or "")


async def test_overload_is_unavailable_with_a_retry_hint(
    start_grpc: Start, backend: FakeBackend
) -> None:
    _, ch = await start_grpc(max_inflight=1)
    stub = pb_grpc.RadixServeStub(ch)
    held = stub.StreamGenerate(pb.GenerateRequest(text="hang"))
    await held.read()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text="hi"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert int(trailers(e.value)["retry-after"]) >= 1
    held.cancel()


async def test_keys_and_the_per_key_budget(start_grpc: Start, backend: FakeBackend) -> None:
    policy = AccessPolicy.from_flags("k-alice", "", max_inflight_per_key=1)
    _, ch = await start_grpc(access=policy)
    stub = pb_grpc.RadixServeStub(ch)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text="hi"))
    assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
    alice = (("authorization", "Bearer k-alice"),)
    held = stub.StreamGenerate(pb.GenerateRequest(text="hang"), metadata=alice)
    await held.read()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text="hi"), metadata=alice)
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert trailers(e.value)["retry-after"] == "1"
    held.cancel()
    await backend.wait_for_abort(backend.requests[0].trace.rid)


async def test_until_ready_calls_are_unavailable(start_grpc: Start, backend: FakeBackend) -> None:
    _, ch = await start_grpc(wait_until_ready=True)  # no service beats in this test's Redis db
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await pb_grpc.RadixServeStub(ch).Generate(pb.GenerateRequest(text="hi"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "the server is starting" in (e.value.details() or "")
    assert "retry-after" in trailers(e.value)


async def test_stop_ends_the_health_watch_though_its_cancel_is_lost(
    start_gateway: Callable[..., Awaitable[Running]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """stop() cancels the health watch, often mid Redis read; before Python 3.12
    asyncio.wait_for (in unready) drops that cancel when the read has just finished, and
    returns its answer. The watch must end anyway, not poll on with stop() waiting for it."""
    reading, polled_again = asyncio.Event(), asyncio.Event()

    async def unready(state: GatewayState) -> str | None:
        if reading.is_set():
            polled_again.set()
        reading.set()
        try:
            await asyncio.Event().wait()  # the read, in flight until cancelled
        except asyncio.CancelledError:
            if polled_again.is_set():
                raise
            return "not ready"  # the first cancel dropped, as wait_for drops it
        return None

    monkeypatch.setattr("services.gateway.grpc.server.unready", unready)
    monkeypatch.setattr("services.gateway.grpc.server.HEALTH_POLL_S", 0.0)  # no pause to poll
    gw = await start_gateway()
    server = GrpcServer(gw.state, "127.0.0.1", 0, drain_timeout_s=1.0)
    await server.start()
    await reading.wait()
    stop = asyncio.create_task(server.stop())
    again = asyncio.create_task(polled_again.wait())
    await asyncio.wait({stop, again}, return_when=asyncio.FIRST_COMPLETED)
    again.cancel()
    if not stop.done():  # the watch polled on: a second cancel ends it, and then stop()
        assert server._watch is not None
        server._watch.cancel()
    await stop
    assert not polled_again.is_set(), "the health watch kept polling after stop()"


async def test_the_clients_deadline_is_the_requests_and_aborts_it(
    text: tuple[Running, pb_grpc.RadixServeStub], backend: FakeBackend
) -> None:
    gw, stub = text
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text="hang"), timeout=0.5)
    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    (req,) = backend.requests
    assert req.trace.hops is not None
    assert req.trace.deadline - req.trace.hops.gateway_received == pytest.approx(0.5, abs=0.2)
    await backend.wait_for_abort(req.trace.rid)
    await wait_until(lambda: gw.state.router.queues == {})


async def test_cancelling_aborts_the_request(
    text: tuple[Running, pb_grpc.RadixServeStub], backend: FakeBackend
) -> None:
    gw, stub = text
    call = stub.StreamGenerate(pb.GenerateRequest(text="hang", rid="cancel-me"))
    await call.read()
    call.cancel()
    assert (await backend.wait_for_abort("cancel-me")).reason == "client cancelled the RPC"
    await wait_until(lambda: not gw.state.dispatcher.inflight.calls)


async def test_bidirectional_stream_refusals_are_per_tag(
    text: tuple[Running, pb_grpc.RadixServeStub], backend: FakeBackend
) -> None:
    _, stub = text
    call = stub.GenerateStream()
    await call.write(pb.StreamRequest(tag="a", generate=pb.GenerateRequest(text="hang")))
    first = await call.read()
    assert first.tag == "a" and first.HasField("chunk")
    await call.write(pb.StreamRequest(tag="a", generate=pb.GenerateRequest(text="hi")))
    await call.write(pb.StreamRequest(tag="empty"))
    await call.write(pb.StreamRequest(tag="b", generate=pb.GenerateRequest(text="too long")))
    await call.write(pb.StreamRequest(tag="c", generate=pb.GenerateRequest(text="hi")))
    errors: dict[str, pb.Error] = {}
    texts: dict[str, str] = {}
    while len(errors) < 3 or "c" not in texts:
        reply = await call.read()
        if reply.HasField("error"):
            errors[reply.tag] = reply.error
        elif reply.chunk.HasField("finish"):
            texts[reply.tag] = reply.chunk.finish.reason
    assert errors["a"].param == "tag" and "already open" in errors["a"].message
    assert errors["empty"].param == "request"
    assert errors["b"].code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert errors["b"].param == "prompt"
    assert texts["c"] == "stop"
    await call.write(pb.StreamRequest(tag="a", cancel=pb.Cancel()))
    cancelled = await call.read()
    assert cancelled.tag == "a" and cancelled.error.code == grpc.StatusCode.CANCELLED.value[0]
    await backend.wait_for_abort(backend.requests[0].trace.rid)
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF  # half-closed with nothing open: the stream ends


async def test_smg_generate_streams_chunks_then_one_complete_per_sample(
    start_grpc: Start, backend: FakeBackend
) -> None:
    _, ch = await start_grpc()
    stub = sgl_grpc.SglangSchedulerStub(ch)
    request = sgl.GenerateRequest(
        request_id="smg-1",
        tokenized=sgl.TokenizedInput(input_ids=[1, 2, 3]),
        sampling_params=sgl.SamplingParams(n=2, max_new_tokens=8),
        stream=True,
    )
    replies = [r async for r in stub.Generate(request)]
    assert {r.request_id for r in replies} == {"smg-1"}
    for i in range(2):
        mine = [r for r in replies if getattr(r, r.WhichOneof("response")).index == i]
        kinds = [r.WhichOneof("response") for r in mine]
        assert kinds[-1] == "complete" and kinds.count("complete") == 1
        ids = [t for r in mine if r.HasField("chunk") for t in r.chunk.token_ids]
        assert ids == [101, 102, 103]
        done = mine[-1].complete
        assert done.finish_reason == "stop" and done.matched_token_id == 2
        assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (5, 3, 2)
        assert list(done.output_ids) == [103]  # the last delta's, as SGLang's servicer sends
    whole = [
        r
        async for r in stub.Generate(
            sgl.GenerateRequest(request_id="smg-2", tokenized=sgl.TokenizedInput(input_ids=[1]))
        )
    ]
    assert [r.WhichOneof("response") for r in whole] == ["complete"]
    assert list(whole[0].complete.output_ids) == [101, 102, 103]
    sent = [q for q in backend.requests if q.trace.rid.startswith("smg-2")]
    assert sent[0].sampling.temperature == 0.0  # proto3's unset temperature: greedy
    assert sent[0].sampling.top_k == -1 and sent[0].sampling.top_p == 1.0
    assert sent[0].sampling.max_new_tokens is None  # no limit given: up to the context
    assert not sent[0].sampling.no_stop_trim
    kept = sgl.GenerateRequest(
        request_id="smg-3",
        tokenized=sgl.TokenizedInput(input_ids=[1]),
        sampling_params=sgl.SamplingParams(stop=["x"], no_stop_trim=True),
    )
    assert [r.WhichOneof("response") async for r in stub.Generate(kept)] == ["complete"]
    sent = [q for q in backend.requests if q.trace.rid.startswith("smg-3")]
    assert sent[0].sampling.no_stop_trim and sent[0].sampling.stop == ["x"]


@pytest.mark.parametrize(
    ("request_", "param"),
    [
        (sgl.GenerateRequest(tokenized=sgl.TokenizedInput()), "tokenized.input_ids"),
        (
            sgl.GenerateRequest(
                tokenized=sgl.TokenizedInput(input_ids=[1]),
                mm_inputs=sgl.MultimodalInputs(image_urls=["http://x/y.png"]),
            ),
            "mm_inputs",
        ),
        (sgl.GenerateRequest(tokenized=sgl.TokenizedInput(input_ids=[1]), lora_id="a"), "lora_id"),
        (
            sgl.GenerateRequest(
                tokenized=sgl.TokenizedInput(input_ids=[1]),
                sampling_params=sgl.SamplingParams(structural_tag="{}"),
            ),
            "sampling_params.structural_tag",
        ),
        (
            sgl.GenerateRequest(
                tokenized=sgl.TokenizedInput(input_ids=[1]),
                sampling_params=sgl.SamplingParams(custom_params=Struct()),
            ),
            "sampling_params.custom_params",
        ),
        (
            sgl.GenerateRequest(
                tokenized=sgl.TokenizedInput(input_ids=[1]),
                sampling_params=sgl.SamplingParams(temperature=-1),
            ),
            "sampling_params.temperature",
        ),
        (
            sgl.GenerateRequest(
                request_id="no spaces", tokenized=sgl.TokenizedInput(input_ids=[1])
            ),
            "request_id",
        ),
    ],
)
async def test_smg_generate_refuses_what_it_cannot_do_by_name(
    start_grpc: Start, backend: FakeBackend, request_: sgl.GenerateRequest, param: str
) -> None:
    _, ch = await start_grpc()
    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in sgl_grpc.SglangSchedulerStub(ch).Generate(request_):
            pass
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert trailers(e.value)["error-param"] == param
    assert backend.requests == []


async def test_smg_embed_needs_an_embedding_server_and_kv_events_are_unimplemented(
    start_grpc: Start,
) -> None:
    _, ch = await start_grpc()
    stub = sgl_grpc.SglangSchedulerStub(ch)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Embed(sgl.EmbedRequest())
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "--is-embedding" in (e.value.details() or "")
    from smg_grpc_proto.generated import common_pb2

    with pytest.raises(grpc.aio.AioRpcError) as e:
        async for _ in stub.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest()):
            pass
    assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED


async def test_a_draining_gateway_refuses_new_calls(
    text: tuple[Running, pb_grpc.RadixServeStub],
) -> None:
    gw, stub = text
    gw.state.draining = True
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await stub.Generate(pb.GenerateRequest(text="hi"))
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (e.value.details() or "")
