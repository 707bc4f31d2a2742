"""SMG's SGLang worker service (`sglang.grpc.scheduler.SglangScheduler`, stubs from
smg-grpc-proto): what the Shepherd Model Gateway calls on a worker it routes to.

SMG tokenizes, applies chat templates and detokenizes itself; the worker takes token ids and
returns token ids. Each RPC follows the HTTP route it stands for (keys, readiness, budgets):
Generate is /generate, Abort /abort_request, FlushCache /flush_cache, the info RPCs their GETs.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any, TypeAlias

import grpc
import numpy as np
from google.protobuf import struct_pb2
from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl
from smg_grpc_proto.generated import sglang_scheduler_pb2_grpc as sgl_grpc

import radixserve
from services.gateway.abort_api import abort_calls
from services.gateway.admin_api import flush_all
from services.gateway.embeddings_api import EmbeddingBody, embedding_jobs, require_mode
from services.gateway.errors import ApiError
from services.gateway.grpc import smg_convert as convert
from services.gateway.grpc.calls import rpc
from services.gateway.grpc.generation import dispatch, replies
from services.gateway.grpc.smg_loads import loads_response
from services.gateway.grpc.tokenizer_zip import TokenizerZips
from services.gateway.health_api import ProbeFailed, probe_generate, unready
from services.gateway.info_api import executor_loads, model_info, public_model_info
from services.gateway.protocol import AbortBody
from services.gateway.state import GatewayState

Context: TypeAlias = grpc.aio.ServicerContext


class SmgService(sgl_grpc.SglangSchedulerServicer):
    def __init__(self, state: GatewayState) -> None:
        self.state = state
        self.tokenizer = TokenizerZips(state.settings.model_path, state.settings.model_name)

    async def Generate(
        self, request: sgl.GenerateRequest, context: Context
    ) -> AsyncIterator[sgl.GenerateResponse]:
        async with rpc(self.state, context, "/generate", budgeted=True) as who:
            require_mode(self.state, embeddings=False)
            body, jobs = convert.generate_jobs(request)
            pendings = await dispatch(self.state, context, who, jobs, "tokenized.input_ids")
            rid, logprobs = request.request_id, body.return_logprob
            async for i, d, acc in replies(pendings):
                if request.stream:
                    yield convert.chunk(rid, i, d, acc, logprobs)
                if d.finish_reason is not None:
                    ids = d.token_ids if request.stream else acc.token_ids
                    yield convert.complete(rid, i, acc, logprobs, ids)

    async def HealthCheck(
        self, request: sgl.HealthCheckRequest, context: Context
    ) -> sgl.HealthCheckResponse:
        """Healthy when a request can be served end to end now (GET /health) and one greedy
        token comes back through every service (GET /health_generate)."""
        why = await unready(self.state)
        if why is not None:
            return sgl.HealthCheckResponse(healthy=False, message=why)
        try:
            probe = await probe_generate(self.state, "")  # no client trace: a new one
        except ProbeFailed as e:
            return sgl.HealthCheckResponse(healthy=False, message=e.message)
        return sgl.HealthCheckResponse(
            healthy=True, message=f"one token in {probe['latency_s']:g}s"
        )

    async def Abort(self, request: sgl.AbortRequest, context: Context) -> sgl.AbortResponse:
        """Abort the Generate call that sent `request_id` (all its samples), on any gateway."""
        async with rpc(self.state, context, "/abort_request") as who:
            try:
                rids = await abort_calls(
                    self.state.dispatcher, who, AbortBody(rid=request.request_id or None)
                )
            except ApiError as e:
                if e.status not in (400, 404):
                    raise
                return sgl.AbortResponse(success=False, message=e.message)
            return sgl.AbortResponse(success=True, message=f"aborted {', '.join(rids)}")

    async def GetModelInfo(
        self, request: sgl.GetModelInfoRequest, context: Context
    ) -> sgl.GetModelInfoResponse:
        # Gated: SMG registers a worker from this answer, so it waits for a ready stack (it
        # retries UNAVAILABLE) rather than register one whose model facts are unknown.
        async with rpc(self.state, context, "/get_model_info") as who:
            info = await model_info(self.state)
            shown = info if who.admin else _without_paths(info)
            architecture = shown["architecture"]
            return sgl.GetModelInfoResponse(
                model_path=shown["model_path"] or "",
                tokenizer_path=shown["tokenizer_path"] or "",
                is_generation=not self.state.settings.is_embedding,
                served_model_name=shown["served_model_name"],
                max_context_length=shown["context_length"] or 0,
                max_req_input_len=max(0, (shown["context_length"] or 0) - 1),
                vocab_size=shown["vocab_size"] or 0,
                supports_vision=False,
                model_type=_model_type(architecture),
                architectures=[architecture] if architecture else [],
                eos_token_ids=shown["eos_token_ids"] or [],
            )

    async def GetServerInfo(
        self, request: sgl.GetServerInfoRequest, context: Context
    ) -> sgl.GetServerInfoResponse:
        async with rpc(self.state, context, "/get_server_info", gated=False) as who:
            info = await model_info(self.state)
            shown = info if who.admin else _without_paths(info)
            executors = await executor_loads(self.state)
            total_tokens = sum(e.total_kv_tokens for e in executors)
            args = _struct(
                {
                    "model_path": shown["model_path"] or "",
                    "tokenizer_path": shown["tokenizer_path"] or "",
                    "served_model_name": shown["served_model_name"],
                    "context_length": shown["context_length"] or 0,
                    "vocab_size": shown["vocab_size"] or 0,
                    "tp_size": max((e.tp_size for e in executors), default=1),
                    "dp_size": len(executors),
                    "max_total_tokens": total_tokens,
                    "max_running_requests": sum(e.max_running for e in executors),
                    "is_embedding": False,
                }
            )
            started = self.state.started
            return sgl.GetServerInfoResponse(
                server_args=args,
                active_requests=len(self.state.dispatcher.inflight.calls),
                is_paused=False,
                uptime_seconds=time.time() - started,
                sglang_version=f"radixserve-{radixserve.__version__}",
                server_type="grpc",
                start_time={"seconds": int(started), "nanos": int(started % 1 * 1e9)},
                max_total_num_tokens=total_tokens,
            )

    async def GetLoads(
        self, request: sgl.GetLoadsRequest, context: Context
    ) -> sgl.GetLoadsResponse:
        async with rpc(self.state, context, "/get_server_info", gated=False):
            dp_rank = request.dp_rank if request.HasField("dp_rank") else None
            loads = await executor_loads(self.state)
            return loads_response(loads, list(request.include), dp_rank)

    async def FlushCache(
        self, request: common_pb2.FlushCacheRequest, context: Context
    ) -> common_pb2.FlushCacheResponse:
        async with rpc(self.state, context, "/flush_cache"):
            try:
                executors = await flush_all(self.state, max(0.0, request.timeout_s))
            except ApiError as e:
                if e.status >= 500:
                    raise
                return common_pb2.FlushCacheResponse(success=False, message=e.message)
            return common_pb2.FlushCacheResponse(
                success=True, message=f"flushed the prefix cache of {executors} executor(s)"
            )

    async def GetTokenizer(
        self, request: common_pb2.GetTokenizerRequest, context: Context
    ) -> AsyncIterator[common_pb2.GetTokenizerChunk]:
        async with rpc(self.state, context, "/get_model_info", gated=False):
            bundle = await self.tokenizer.get()
            pieces = bundle.chunks()
            for n, piece in enumerate(pieces):
                last = n == len(pieces) - 1
                yield common_pb2.GetTokenizerChunk(data=piece, sha256=bundle.sha256 if last else "")

    async def Embed(self, request: sgl.EmbedRequest, context: Context) -> sgl.EmbedResponse:
        """The pooled embedding of `tokenized.input_ids` (a server started with --is-embedding;
        INVALID_ARGUMENT otherwise, as a generation request is on an embedding server)."""
        async with rpc(self.state, context, "/v1/embeddings", budgeted=True) as who:
            require_mode(self.state, embeddings=True)
            ids = list(request.tokenized.input_ids)
            if not ids:
                raise ApiError(400, "tokenized.input_ids must not be empty", "tokenized.input_ids")
            jobs = embedding_jobs(EmbeddingBody(input=ids), self.state.settings.model_name)
            pendings = await dispatch(self.state, context, who, jobs, "tokenized.input_ids")
            async for _, d, acc in replies(pendings):
                if d.finish_reason is not None and acc.embedding is not None:
                    vector = np.frombuffer(acc.embedding, dtype="<f4")
                    return sgl.EmbedResponse(
                        embedding=vector.tolist(),
                        embedding_dim=len(vector),
                        prompt_tokens=acc.usage.prompt_tokens,
                    )
        raise ApiError(500, "the embedding request ended without its vector", type="server_error")

    async def SubscribeKvEvents(
        self, request: common_pb2.SubscribeKvEventsRequest, context: Context
    ) -> AsyncIterator[common_pb2.KvEventBatch]:
        # SMG then routes cache-aware from its own approximate radix tree over the token ids.
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            "SubscribeKvEvents: this worker publishes no KV cache events",
        )
        yield common_pb2.KvEventBatch()  # unreachable: makes this a server-streaming handler


def _without_paths(info: dict[str, Any]) -> dict[str, Any]:
    """For callers without the admin key: no paths (SMG then uses its own --tokenizer-path or
    asks for GetTokenizer), where HTTP shows the file name."""
    return {**public_model_info(info), "model_path": "", "tokenizer_path": ""}


def _model_type(architecture: str | None) -> str:
    """config.json's model_type for an architecture name: LlamaForCausalLM -> llama."""
    if not architecture:
        return ""
    return architecture.removesuffix("ForCausalLM").lower()


def _struct(values: dict[str, Any]) -> struct_pb2.Struct:
    s = struct_pb2.Struct()
    s.update(values)
    return s
