"""The serving benchmark over gRPC: `--backend grpc` (radixserve.v1.RadixServe's
StreamGenerate, text in and out, the same request as `--backend radixserve` over HTTP) and
`--backend grpc-smg` (SMG's SGLang worker protocol, as the SMG gateway drives a worker: the
client tokenizes, and the worker streams token ids, then one GenerateComplete).

Every request goes over one shared channel (HTTP/2 multiplexes them), as a gRPC client would
send them. Chunks that carried new tokens are the arrival times inter-token latency is
computed from, as with HTTP's SSE events.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

import grpc
import tokenizers
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

from loadtest.backends import Backend, Message, Options, RequestResult, Usage, flatten
from shared.grpc_api import radixserve_pb2 as pb
from shared.grpc_api import radixserve_pb2_grpc as pb_grpc


class GrpcBackend(Backend):
    """A backend reached over a gRPC channel instead of an HTTP URL."""

    def __init__(self, tokenizer: tokenizers.Tokenizer | None = None) -> None:
        self.tokenizer = tokenizer

    async def call(self, channel: grpc.aio.Channel, body: Any, prompt_len: int) -> RequestResult:
        r = RequestResult(ok=False, start=time.perf_counter(), end=0.0, prompt_len=prompt_len)
        try:
            await self.stream(channel, body, r)
        except grpc.aio.AioRpcError as e:
            r.error = f"gRPC {e.code().name}: {e.details()}"
        r.end = time.perf_counter()
        r.ok = r.error is None
        return r

    async def stream(self, channel: grpc.aio.Channel, body: Any, r: RequestResult) -> None:
        raise NotImplementedError

    def parse(self, event: dict[str, Any], text_so_far: str) -> tuple[str, Usage | None]:
        raise TypeError("a gRPC backend reads messages, not SSE events")


class RadixServeGrpc(GrpcBackend):
    def body(
        self, messages: list[Message], output_len: int, schema: dict[str, Any] | None, o: Options
    ) -> pb.GenerateRequest:
        params = pb.SamplingParams(max_new_tokens=output_len, temperature=o.temperature)
        if o.ignore_eos and schema is None:
            params.ignore_eos = True
        if schema is not None:
            params.json_schema = json.dumps(schema)
        return pb.GenerateRequest(text=flatten(messages), sampling_params=params)

    async def stream(
        self, channel: grpc.aio.Channel, body: pb.GenerateRequest, r: RequestResult
    ) -> None:
        async for c in pb_grpc.RadixServeStub(channel).StreamGenerate(body):
            if c.token_ids:
                r.chunk_times.append(time.perf_counter())
                r.text += c.text
            if c.HasField("finish"):
                u = c.usage
                r.usage = Usage(u.prompt_tokens, u.completion_tokens, u.cached_tokens)
                return
        r.error = "the stream ended before the request finished"


class SmgGrpc(GrpcBackend):
    """The client tokenizes (as the SMG gateway does); the answer's text is decoded at its end."""

    def body(
        self, messages: list[Message], output_len: int, schema: dict[str, Any] | None, o: Options
    ) -> sgl.GenerateRequest:
        assert self.tokenizer is not None, "grpc-smg needs the model's tokenizer"
        params = sgl.SamplingParams(
            max_new_tokens=output_len,
            temperature=o.temperature,
            top_p=1.0,
            top_k=-1,
            repetition_penalty=1.0,
            skip_special_tokens=True,
            spaces_between_special_tokens=True,
            n=1,
        )
        if o.ignore_eos and schema is None:
            params.ignore_eos = True
        if schema is not None:
            params.json_schema = json.dumps(schema)
        ids = self.tokenizer.encode(flatten(messages)).ids
        return sgl.GenerateRequest(
            request_id=f"bench-{uuid.uuid4().hex}",
            tokenized=sgl.TokenizedInput(input_ids=ids),
            sampling_params=params,
            stream=True,
        )

    async def stream(
        self, channel: grpc.aio.Channel, body: sgl.GenerateRequest, r: RequestResult
    ) -> None:
        assert self.tokenizer is not None
        ids: list[int] = []
        async for reply in sgl_grpc.SglangSchedulerStub(channel).Generate(body):
            if reply.HasField("chunk"):
                if reply.chunk.token_ids:
                    r.chunk_times.append(time.perf_counter())
                    ids += reply.chunk.token_ids
                continue
            done = reply.complete
            r.usage = Usage(done.prompt_tokens, done.completion_tokens, done.cached_tokens)
            r.text = self.tokenizer.decode(ids, skip_special_tokens=True)
            return
        r.error = "the stream ended without a GenerateComplete"


GRPC_BACKENDS: dict[str, type[GrpcBackend]] = {"grpc": RadixServeGrpc, "grpc-smg": SmgGrpc}
