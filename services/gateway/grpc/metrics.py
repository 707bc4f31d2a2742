"""Counting every RPC's final status in radixserve:responses_total (protocol "grpc"), as the
HTTP middleware counts status codes: a server interceptor that asks each call's context for
its code once the call is done."""

from __future__ import annotations

import inspect
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc

from services.gateway.metrics import GatewayMetrics

_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def final_code(context: Any) -> str:
    if context.cancelled():
        return grpc.StatusCode.CANCELLED.name
    code = context.code()
    if isinstance(code, grpc.StatusCode):
        return code.name
    return grpc.StatusCode.OK.name if code in (None, 0) else str(code)


class ResponseCounter(grpc.aio.ServerInterceptor):
    def __init__(self, metrics: GatewayMetrics) -> None:
        self.metrics = metrics

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(details)
        if handler is None or not self.metrics.enabled:
            return handler
        method = details.method
        kind = (handler.request_streaming, handler.response_streaming)
        behavior = {
            (False, False): handler.unary_unary,
            (False, True): handler.unary_stream,
            (True, False): handler.stream_unary,
            (True, True): handler.stream_stream,
        }[kind]

        def done(context: Any) -> None:
            self.metrics.response("grpc", method, final_code(context))

        wrapped: Any
        if inspect.isasyncgenfunction(behavior):

            async def stream(request: Any, context: Any) -> AsyncIterator[Any]:
                context.add_done_callback(done)
                async for item in behavior(request, context):
                    yield item

            wrapped = stream
        else:

            async def call(request: Any, context: Any) -> Any:
                context.add_done_callback(done)
                return await behavior(request, context)

            wrapped = call
        return _MAKERS[kind](
            wrapped,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )
