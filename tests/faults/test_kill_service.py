"""Each service SIGKILLed under a steady load: no request hangs, and where the issue says a
service's death loses nothing, nothing fails (a 503 with Retry-After, retried by the client,
counts as retried, not failed)."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.fault_stack import Stack
from loadtest.faults import ensure_executors, kill, under_load
from tests.faults.conftest import GRAMMAR_SETTINGS, SETTINGS

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.faults]


@pytest.mark.parametrize("service", ["tokenizer", "scheduler", "detokenizer"])
def test_a_killed_stage_loses_no_request(fault_stack: Stack, service: str) -> None:
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, service), SETTINGS))
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"


def test_a_killed_grammar_service_loses_no_constrained_request(fault_stack: Stack) -> None:
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "grammar"), GRAMMAR_SETTINGS))
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"


def test_one_of_two_executors_killed(fault_stack: Stack) -> None:
    """Work the dead executor had not started goes to the live one; work it was generating
    comes back as a retryable 503 (the driver retries it): nothing fails, nothing hangs."""
    ensure_executors(fault_stack, 2, fault_stack.serve_args, 300.0)
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "executor"), SETTINGS))
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, t.row()


def test_a_killed_gateway_drops_connections_and_its_successor_serves(fault_stack: Stack) -> None:
    """Its clients see connection errors (they know at once), none hang, and the gateway the
    supervisor starts again serves the requests sent after it."""
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "gateway"), SETTINGS))
    assert t.hung == 0, t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"
