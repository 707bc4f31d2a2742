"""--reuse-port: gateways share one HTTP and one gRPC port when every one of them asks to
(`radixserve serve --gateway-replicas`); without it a port in use stays a clear error."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from aiohttp import web

from services.gateway.app import ListenError, bound_port, build_app, start_site
from services.gateway.grpc.server import GrpcServer
from services.gateway.main import build_parser
from services.gateway.state import GatewaySettings
from tests.conftest import free_port
from tests.gateway.helpers import Running

pytestmark = pytest.mark.redis

Site = Callable[[int, bool], Awaitable[web.AppRunner]]


@pytest.fixture
async def site(redis_url: str) -> AsyncIterator[Site]:
    runners: list[web.AppRunner] = []

    async def start(port: int, reuse_port: bool) -> web.AppRunner:
        settings = GatewaySettings(
            redis_url=redis_url, instance_id=f"gw-listen-{len(runners)}", model_name="m"
        )
        runner = await start_site(await build_app(settings), "127.0.0.1", port, 1.0, reuse_port)
        runners.append(runner)
        return runner

    yield start
    for runner in runners:
        await runner.cleanup()


def test_the_flag_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    assert build_parser().parse_args([]).reuse_port is False
    assert build_parser().parse_args(["--reuse-port"]).reuse_port is True
    monkeypatch.setenv("RADIXSERVE_REUSE_PORT", "true")
    assert build_parser().parse_args([]).reuse_port is True


async def test_a_port_in_use_is_an_error_without_reuse_port(site: Site) -> None:
    port = bound_port(await site(0, False))
    with pytest.raises(ListenError, match=f"cannot listen on 127.0.0.1:{port}"):
        await site(port, False)
    with pytest.raises(ListenError):  # every socket on the port must have asked to share it
        await site(port, True)


async def test_gateways_with_reuse_port_share_one_port(site: Site) -> None:
    first = await site(0, True)
    port = bound_port(first)
    second = await site(port, True)
    assert bound_port(second) == port


async def test_grpc_servers_share_a_port_only_with_reuse_port(
    start_gateway: Callable[..., Awaitable[Running]],
) -> None:
    gw = await start_gateway()
    port = free_port()
    servers = [GrpcServer(gw.state, "127.0.0.1", port, 1.0, reuse_port=True) for _ in range(2)]
    lone = GrpcServer(gw.state, "127.0.0.1", port, 1.0)
    try:
        assert [await s.start() for s in servers] == [port, port]
        with pytest.raises(ListenError, match=f"cannot listen for gRPC on 127.0.0.1:{port}"):
            await lone.start()
    finally:
        for s in servers:
            await s.stop()
