"""Load progress: what the executor publishes and what `radixserve serve` prints of it."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest
import redis

from radixserve.progress import ProgressDisplay, read_progress
from services.executor.load_progress import PHASES, ProgressReporter
from shared.messages.progress import LoadProgress


@pytest.mark.redis
def test_the_reporter_publishes_the_share_of_the_whole_load(
    redis_url: str, redis_sync: redis.Redis
) -> None:
    report = ProgressReporter(redis_url, "executor-0.0")
    report("weights", 0.5)
    (p,) = read_progress(redis_sync)
    assert p.instance == "executor-0.0" and p.phase == "weights"
    assert p.fraction == pytest.approx(0.45)  # weights span 5% to 85% of the load
    report("kv pool", 0.0)
    assert read_progress(redis_sync)[0].phase == "kv pool"
    report.finish()  # loaded: nothing left to show
    assert read_progress(redis_sync) == []


def test_a_log_gets_a_line_per_phase_and_tenth_not_per_update() -> None:
    out = io.StringIO()
    display = ProgressDisplay(out)
    for fraction in (0.05, 0.06, 0.07, 0.12, 0.13):
        display.show([LoadProgress(instance="e", phase="weights", fraction=fraction, ts=0.0)])
    display.show([LoadProgress(instance="e", phase="kv pool", fraction=0.13, ts=0.0)])
    lines = out.getvalue().splitlines()
    assert len(lines) == 3, lines
    assert lines[0] == "loading model [##----------------------------]   5% weights (e)"
    assert lines[1].endswith(" 12% weights (e)") and lines[2].endswith(" 13% kv pool (e)")


def test_every_phase_the_executor_reports_has_a_share() -> None:
    """The builder's and the executor's progress phases are PHASES' keys: the reporter looks
    each one up, so a phase without a share would stop the load with a KeyError."""
    root = Path(__file__).resolve().parents[2] / "services" / "executor"
    reported = {
        phase
        for name in ("builder.py", "main.py")
        for phase in re.findall(r'progress\("([^"]+)"', (root / name).read_text())
    }
    assert "kernel timing" in reported
    assert reported <= set(PHASES), reported - set(PHASES)
