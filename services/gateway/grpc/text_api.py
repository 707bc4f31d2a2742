"""radixserve's own gRPC service (radixserve.v1.RadixServe): text in and out.

Each RPC stands for the HTTP route whose rules it follows (keys, readiness, the per-key
budget): Generate and GenerateStream for /generate, Chat for /generate with a chat prompt,
Tokenize and Detokenize for theirs, Abort for /abort_request. The bidirectional stream lives
in text_stream.py.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TypeAlias

import grpc

from services.gateway.abort_api import abort_calls
from services.gateway.access_policy import Caller
from services.gateway.grpc import text_convert as convert
from services.gateway.grpc.calls import rpc
from services.gateway.grpc.generation import collect, dispatch, replies
from services.gateway.grpc.text_stream import multiplex
from services.gateway.info_api import model_info, public_model_info
from services.gateway.state import GatewayState
from services.gateway.tokenize_api import detokenize_call, tokenize_call
from services.gateway.validation import Job
from shared.grpc_api import radixserve_pb2 as pb
from shared.grpc_api import radixserve_pb2_grpc as pb_grpc

Context: TypeAlias = grpc.aio.ServicerContext


class TextService(pb_grpc.RadixServeServicer):
    def __init__(self, state: GatewayState) -> None:
        self.state = state

    async def Generate(self, request: pb.GenerateRequest, context: Context) -> pb.GenerateResponse:
        async with rpc(self.state, context, "/generate", budgeted=True) as who:
            jobs = convert.generate_jobs(request, stream=False)
            return await self._whole(context, who, jobs, "text")

    async def StreamGenerate(
        self, request: pb.GenerateRequest, context: Context
    ) -> AsyncIterator[pb.GenerateChunk]:
        async with rpc(self.state, context, "/generate", budgeted=True) as who:
            jobs = convert.generate_jobs(request, stream=True)
            async for c in self._chunks(context, who, jobs, "text"):
                yield c

    async def Chat(self, request: pb.ChatRequest, context: Context) -> pb.GenerateResponse:
        async with rpc(self.state, context, "/generate", budgeted=True) as who:
            jobs = convert.chat_jobs(request, stream=False)
            return await self._whole(context, who, jobs, "messages")

    async def StreamChat(
        self, request: pb.ChatRequest, context: Context
    ) -> AsyncIterator[pb.GenerateChunk]:
        async with rpc(self.state, context, "/generate", budgeted=True) as who:
            jobs = convert.chat_jobs(request, stream=True)
            async for c in self._chunks(context, who, jobs, "messages"):
                yield c

    async def GenerateStream(
        self, request_iterator: AsyncIterator[pb.StreamRequest], context: Context
    ) -> AsyncIterator[pb.StreamResponse]:
        async with rpc(self.state, context, "/generate") as who:
            async for reply in multiplex(self.state, context, who, request_iterator):
                yield reply

    async def Tokenize(self, request: pb.TokenizeRequest, context: Context) -> pb.TokenizeResponse:
        async with rpc(self.state, context, "/tokenize"):
            reply = await tokenize_call(self.state, convert.tokenize_body(request))
            ids = reply.token_ids
            return pb.TokenizeResponse(
                tokens=ids, count=len(ids), max_model_len=reply.max_model_len
            )

    async def Detokenize(
        self, request: pb.DetokenizeRequest, context: Context
    ) -> pb.DetokenizeResponse:
        async with rpc(self.state, context, "/detokenize"):
            text = await detokenize_call(self.state, convert.detokenize_body(request))
            return pb.DetokenizeResponse(text=text)

    async def Abort(self, request: pb.AbortRequest, context: Context) -> pb.AbortResponse:
        async with rpc(self.state, context, "/abort_request") as who:
            rids = await abort_calls(self.state.dispatcher, who, convert.abort_body(request))
            return pb.AbortResponse(aborted=rids)

    async def ModelInfo(
        self, request: pb.ModelInfoRequest, context: Context
    ) -> pb.ModelInfoResponse:
        async with rpc(self.state, context, "/get_model_info", gated=False) as who:
            info = await model_info(self.state)
            shown = info if who.admin else public_model_info(info)
            return pb.ModelInfoResponse(
                served_model_name=shown["served_model_name"] or "",
                model_path=shown["model_path"] or "",
                context_length=shown["context_length"] or 0,
                architecture=shown["architecture"] or "",
                vocab_size=shown["vocab_size"] or 0,
                eos_token_ids=shown["eos_token_ids"] or [],
                has_chat_template=bool(shown["has_chat_template"]),
            )

    # -- the generations' two shapes ---------------------------------------------------------
    async def _whole(
        self, context: Context, who: Caller, jobs: list[Job], param: str
    ) -> pb.GenerateResponse:
        pendings = await dispatch(self.state, context, who, jobs, param)
        accs = await collect(pendings)
        return pb.GenerateResponse(
            choices=[
                convert.choice(i, p.rid, a)
                for i, (p, a) in enumerate(zip(pendings, accs, strict=True))
            ]
        )

    async def _chunks(
        self, context: Context, who: Caller, jobs: list[Job], param: str
    ) -> AsyncIterator[pb.GenerateChunk]:
        pendings = await dispatch(self.state, context, who, jobs, param)
        async for i, d, acc in replies(pendings):
            yield convert.chunk(i, pendings[i].rid, d, acc)
