"""A service's own process freezes its startup heap before serving; a Service run inside
another program (here, pytest) leaves that program's collector alone."""

from __future__ import annotations

import gc
import subprocess
import sys

import pytest

from shared.service import Service

pytestmark = [pytest.mark.redis]

# The child runs a Service through run_async, as a service's `main` does, and prints how
# many objects the collector had frozen while its worker ran.
CHILD = """
import gc, sys
from shared.service import Service, run_async

async def main():
    svc = Service("heap-test", "h1", sys.argv[1])
    seen = []

    async def work():
        seen.append(gc.get_freeze_count())

    await svc.run(work)
    print(seen[0])

run_async(main)
"""


def test_a_service_process_freezes_its_startup_heap(redis_url: str) -> None:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, redis_url], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) > 1000  # the imported modules, at the least


async def test_a_service_inside_another_program_freezes_nothing(redis_url: str) -> None:
    before = gc.get_freeze_count()
    svc = Service("heap-test", "h2", redis_url)
    seen: list[int] = []

    async def work() -> None:
        seen.append(gc.get_freeze_count())

    await svc.run(work)
    assert seen == [before]
