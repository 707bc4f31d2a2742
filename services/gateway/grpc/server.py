"""The gateway's gRPC server (`--grpc-port`), beside its HTTP site on the same event loop and
GatewayState: SMG's SGLang worker service, radixserve's own text service, the standard
grpc.health.v1 service (SERVING exactly when GET /health would be 200) and server reflection."""

from __future__ import annotations

import asyncio
import logging

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto.generated import sglang_scheduler_pb2, sglang_scheduler_pb2_grpc

from services.gateway.app import ListenError
from services.gateway.grpc.metrics import ResponseCounter
from services.gateway.grpc.smg_api import SmgService
from services.gateway.grpc.text_api import TextService
from services.gateway.health_api import unready
from services.gateway.state import GatewayState
from shared.grpc_api import radixserve_pb2, radixserve_pb2_grpc

log = logging.getLogger(__name__)

HEALTH_POLL_S = 1.0  # how often the health service's status follows the stack's readiness
SERVICES = (
    radixserve_pb2.DESCRIPTOR.services_by_name["RadixServe"].full_name,
    sglang_scheduler_pb2.DESCRIPTOR.services_by_name["SglangScheduler"].full_name,
)


class GrpcServer:
    def __init__(
        self,
        state: GatewayState,
        host: str,
        port: int,
        drain_timeout_s: float,
        reuse_port: bool = False,
    ) -> None:
        self.state, self.host, self.port = state, host, port
        self.drain_timeout_s = drain_timeout_s
        limit = state.settings.max_body_bytes  # a message is a body: the same bound as HTTP
        self.server = grpc.aio.server(
            interceptors=[ResponseCounter(state.dispatcher.metrics)],
            options=[
                ("grpc.max_receive_message_length", limit),
                ("grpc.max_send_message_length", limit),
                # Off, a port in use is an error; on, gateway replicas share the port.
                ("grpc.so_reuseport", int(reuse_port)),
            ],
        )
        self.health = health_aio.HealthServicer()
        self._watch: asyncio.Task[None] | None = None
        self._stopping = False  # the health watch's own way out: see _follow_readiness

    async def start(self) -> int:
        """Serve; the bound port (an ephemeral one when `port` is 0)."""
        s = self.server
        radixserve_pb2_grpc.add_RadixServeServicer_to_server(TextService(self.state), s)
        sglang_scheduler_pb2_grpc.add_SglangSchedulerServicer_to_server(SmgService(self.state), s)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, s)
        names = (*SERVICES, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name)
        reflection.enable_server_reflection((*names, reflection.SERVICE_NAME), s)
        try:
            bound = s.add_insecure_port(f"{self.host}:{self.port}")
        except RuntimeError as e:  # grpcio's way of saying the port cannot be bound
            raise ListenError(f"cannot listen for gRPC on {self.host}:{self.port}: {e}") from None
        await self._set_health(False)
        await s.start()
        self._watch = asyncio.create_task(self._follow_readiness(), name="grpc-health")
        return bound

    async def stop(self) -> None:
        """Stop taking calls; the ones in flight get `drain_timeout_s` to finish."""
        self._stopping = True
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.health.enter_graceful_shutdown()
        await self.server.stop(self.drain_timeout_s)

    async def _set_health(self, serving: bool) -> None:
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", *SERVICES):
            await self.health.set(name, status)

    async def _follow_readiness(self) -> None:
        # Ends on `_stopping` as well as on stop()'s cancel, which an awaited call can lose:
        # Python 3.11's asyncio.wait_for (unready's Redis read once went through it) returned
        # the result of a read that had just finished when the cancel came, dropping the
        # cancel, and this loop polled on while stop() waited forever (hung test teardowns).
        # unready now waits with asyncio.timeout, which keeps the cancel; the flag stays so
        # that no call under unready can bring the hang back.
        last: bool | None = None
        while not self._stopping:
            why = await unready(self.state)
            if self._stopping:
                return
            serving = why is None
            if serving != last:
                log.debug("gRPC health: %s", "serving" if serving else f"not serving ({why})")
                await self._set_health(serving)
                last = serving
            await asyncio.sleep(HEALTH_POLL_S)
