"""schemathesis over GET /openapi.json against the real gateway app (the fake backend behind
it): no generated request, valid or not, gets a 5xx, a status the document does not list, or a
body that does not match its documented schema. Bounded and derandomized so it stays fast."""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis.asyncio as aioredis
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.core.result import Ok
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from services.gateway.app import bound_port, build_app, start_site
from services.gateway.openapi import document
from services.gateway.state import GatewaySettings
from tests.gateway.fake_backend import FakeBackend
from tests.gateway.helpers import MODEL

pytestmark = [pytest.mark.redis, pytest.mark.slow]


def no_internal_error(ctx: Any, response: Any, case: Any) -> None:
    """No 500 (a crash). The documented 503/504 are deliberate here: the fake backend has no
    live stages, so readiness probes and admin calls say so; status_code_conformance holds them
    to the document."""
    assert response.status_code != 500, f"500 for {case.method} {case.path}: {response.text}"


CHECKS = [
    no_internal_error,
    status_code_conformance,
    content_type_conformance,
    response_schema_conformance,
]
EXAMPLES = 12  # per operation and mode: ~15 operations x 2 modes stays well under a minute


class GatewayThread:
    """The gateway and the fake backend on their own event loop, so the synchronous client
    schemathesis drives can call them from the test's thread."""

    def __init__(self, redis_url: str) -> None:
        self.redis_url = redis_url
        self.loop = asyncio.new_event_loop()
        self.url = ""
        self.stop_event: asyncio.Event | None = None
        self.thread = threading.Thread(target=self.loop.run_until_complete, args=(self._run(),))
        self.started = threading.Event()

    async def _run(self) -> None:
        self.stop_event = asyncio.Event()
        r = aioredis.from_url(self.redis_url)
        backend = FakeBackend(r)
        await backend.start()
        gw_settings = GatewaySettings(
            redis_url=self.redis_url,
            instance_id=f"gw-{uuid.uuid4().hex[:8]}",
            model_name=MODEL,
            request_timeout_s=5.0,
        )
        runner = await start_site(await build_app(gw_settings), "127.0.0.1", 0, 2.0)
        self.url = f"http://127.0.0.1:{bound_port(runner)}"
        self.started.set()
        try:
            await self.stop_event.wait()
        finally:
            await runner.cleanup()
            await backend.stop()
            await r.aclose()

    def __enter__(self) -> GatewayThread:
        self.thread.start()
        assert self.started.wait(30), "the gateway did not start"
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self.stop_event is not None
        self.loop.call_soon_threadsafe(self.stop_event.set)
        self.thread.join(30)
        self.loop.close()


@pytest.fixture
def gateway(redis_url: str) -> Iterator[GatewayThread]:
    with GatewayThread(redis_url) as gw:
        yield gw


def test_the_openapi_document_holds_against_the_app(gateway: GatewayThread) -> None:
    schema = schemathesis.openapi.from_dict(document())
    operations = []
    for result in schema.get_all_operations():
        assert isinstance(result, Ok), result  # every operation in the document loads
        operations.append(result.ok())
    assert len(operations) >= 14
    for operation in operations:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @given(case=operation.as_strategy(mode))
            @settings(
                max_examples=EXAMPLES,
                derandomize=True,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
            )
            def check(case: Any) -> None:
                case.call_and_validate(base_url=gateway.url, checks=CHECKS, timeout=10)

            try:
                check()
            except Unsatisfiable:  # nothing to make invalid: no body and no parameters
                assert mode is GenerationMode.NEGATIVE and "requestBody" not in str(operation)
