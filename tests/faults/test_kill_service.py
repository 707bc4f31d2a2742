"""Each service SIGKILLed under a steady load: no request hangs, and where the issue says a
service's death loses nothing, nothing fails (a 503 with Retry-After, retried by the client,
counts as retried, not failed)."""

from __future__ import annotations

import asyncio

import pytest

from loadtest.fault_stack import Stack, wait_for
from loadtest.faults import ensure_executors, kill, under_load
from tests.faults.conftest import GRAMMAR_SETTINGS, SETTINGS

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.faults]


@pytest.mark.parametrize("service", ["tokenizer", "scheduler", "detokenizer"])
def test_a_killed_stage_loses_no_request(fault_stack: Stack, service: str) -> None:
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, service), SETTINGS))
    assert t.in_flight_at_fault > 0, t.row()  # the kill met requests mid-flight
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"


def test_a_killed_grammar_service_loses_no_constrained_request(fault_stack: Stack) -> None:
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "grammar"), GRAMMAR_SETTINGS))
    assert t.in_flight_at_fault > 0, t.row()  # the kill met requests mid-flight
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"


def test_a_killed_gateway_drops_connections_and_its_successor_serves(fault_stack: Stack) -> None:
    """Its clients see connection errors (they know at once), none hang, and the gateway the
    supervisor starts again serves the requests sent after it."""
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "gateway"), SETTINGS))
    assert t.in_flight_at_fault > 0, t.row()
    assert t.hung == 0, t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"


def test_a_killed_executors_requests_resume_on_the_other(fault_stack: Stack) -> None:
    """With a second executor running, the requests of the one killed (queued or
    mid-generation) resume there: none fails, none hangs."""
    ensure_executors(fault_stack, 2, fault_stack.serve_args, 300.0)
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "executor"), SETTINGS))
    assert t.in_flight_at_fault > 0, t.row()
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"
    # The next scenario starts from a whole stack: the restarted executor has loaded.
    wait_for(lambda: fault_stack.live_instances("executor") >= 2, 120, "the restarted executor")


def test_the_only_executors_requests_wait_for_its_restart(fault_stack: Stack) -> None:
    """With one executor, the requests it held wait for the supervisor's restart of it
    (--resume-wait) and resume there; requests sent meanwhile are refused with Retry-After
    and served when retried: none fails, none hangs."""
    for proc in fault_stack.extra:  # leave the supervisor's own executor alone
        proc.kill()
        proc.wait()
    wait_for(lambda: fault_stack.live_instances("executor") == 1, 60, "one executor")
    seen = len(fault_stack.log_path.read_text(errors="replace"))
    t = asyncio.run(under_load(fault_stack, kill(fault_stack, "executor"), SETTINGS))
    assert t.in_flight_at_fault > 0, t.row()
    assert (t.hung, t.failed) == (0, 0), t.row()
    assert t.recover_s is not None, f"not serving again: {t.row()}\n{fault_stack.log_tail()}"
    log = fault_stack.log_path.read_text(errors="replace")[seen:]
    # Its requests waited and resumed on the restarted executor, none refused for want of one.
    assert "resuming it elsewhere" in log and "no executor came back" not in log
