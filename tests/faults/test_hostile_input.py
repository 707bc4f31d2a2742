"""The issue's hostile inputs: each answered 4xx, and no service died of it (the same
processes serve the next ordinary request)."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest

from loadtest.attempt import send
from loadtest.fault_stack import SERVICES, Stack
from loadtest.faults import Settings, hostile_answers

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.faults]


async def ordinary_request(stack: Stack) -> int | None:
    async with aiohttp.ClientSession() as session:
        out = await send(session, stack.base_url + "/v1/completions", Settings().body(), 60, True)
    return out.status


def test_hostile_inputs_are_refused_and_nothing_dies(fault_stack: Stack) -> None:
    before = {s: sorted(fault_stack.pids(s)) for s in SERVICES}
    answers = asyncio.run(hostile_answers(fault_stack, 30.0))
    wrong = [a for a in answers if a["status"] is None or not 400 <= a["status"] < 500]
    assert not wrong, [(a["name"], a["status"], a["detail"][:120]) for a in wrong]
    assert asyncio.run(ordinary_request(fault_stack)) == 200
    assert {s: sorted(fault_stack.pids(s)) for s in SERVICES} == before
