"""Redis stopped for a few seconds under load and started again on the same port (empty, as
after a crash): requests in flight finish or fail with an answer, none hang, and the stack
serves again without being restarted."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.fault_stack import Stack
from loadtest.faults import restart_redis, under_load
from tests.faults.conftest import SETTINGS

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.faults]


def test_the_stack_serves_again_after_redis_restarts(fault_stack: Stack) -> None:
    pids = {s: fault_stack.pids(s) for s in ("gateway", "scheduler", "executor")}
    t = asyncio.run(under_load(fault_stack, restart_redis(fault_stack, 3.0), SETTINGS))
    print(t.row())
    assert t.in_flight_at_fault > 0, t.row()  # the outage met requests mid-flight
    assert t.hung == 0, t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"
    fault_stack.wait_healthy(30)
    # The services rode it out: reconnected, not replaced by the supervisor.
    assert {s: fault_stack.pids(s) for s in pids} == pids
