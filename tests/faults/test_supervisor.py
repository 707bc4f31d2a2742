"""`radixserve serve` as a supervisor: a child killed is started again, /health says so while
it is gone, and serve itself stays up."""

from __future__ import annotations

import time
import urllib.error
import urllib.request

import pytest

from loadtest.fault_stack import Stack

pytestmark = [pytest.mark.redis, pytest.mark.slow, pytest.mark.faults]


def health_status(stack: Stack) -> int | None:
    try:
        with urllib.request.urlopen(f"{stack.base_url}/health", timeout=2) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except OSError:
        return None


def test_a_killed_child_is_restarted_and_health_reports_the_gap(fault_stack: Stack) -> None:
    old = fault_stack.kill("scheduler")
    # /health turns 503 while a stage is gone (the issue: within about 2 s).
    deadline = time.monotonic() + 5.0
    seen = []
    while time.monotonic() < deadline:
        seen.append(health_status(fault_stack))
        if seen[-1] == 503:
            break
        time.sleep(0.1)
    assert seen[-1] == 503, f"/health answered {seen} with the scheduler dead"
    fault_stack.wait_replaced("scheduler", old, 60)
    fault_stack.wait_healthy(60)
    assert fault_stack.serve_alive(), fault_stack.log_tail()
