"""Gateways on real ports against the session's Redis, with the scripted fake backend."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import pytest
import redis.asyncio as aioredis
from aiohttp import web

from services.gateway.access_policy import AccessPolicy
from services.gateway.app import bound_port, build_app, start_site
from services.gateway.state import STATE, GatewaySettings
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL, Running


@pytest.fixture
async def backend(aredis: aioredis.Redis) -> AsyncIterator[FakeBackend]:
    fake = FakeBackend(aredis)
    await fake.start()
    yield fake
    await fake.stop()


@pytest.fixture
async def start_gateway(
    redis_url: str, backend: FakeBackend
) -> AsyncIterator[Callable[..., Awaitable[Running]]]:
    runners: list[web.AppRunner] = []

    async def start(
        timeout: float = 5.0, access: AccessPolicy | None = None, **overrides: Any
    ) -> Running:
        settings = GatewaySettings(
            redis_url=redis_url,
            instance_id=f"gw-{uuid.uuid4().hex[:8]}",
            model_name=MODEL,
            request_timeout_s=timeout,
            **overrides,
        )
        app = await build_app(settings, access_policy=access)
        runner = await start_site(app, "127.0.0.1", 0, shutdown_timeout=2.0)
        runners.append(runner)
        return Running(f"http://127.0.0.1:{bound_port(runner)}", app[STATE], runner)

    yield start
    for runner in runners:
        await runner.cleanup()


@pytest.fixture
async def gw(start_gateway: Callable[..., Awaitable[Running]]) -> Running:
    return await start_gateway()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session
