"""Per-stage latency of a first token from its HopTimes, and the gateway's medians."""

from __future__ import annotations

from services.gateway.hop_stats import STAGES, FirstToken, HopStats, stage_ms
from shared.messages.common import HopTimes

# one stamp per millisecond-ish step, in path order (unix seconds)
FULL = HopTimes(
    gateway_received=100.000,
    tokenized=100.002,
    routed=100.003,
    executor_inbox=100.004,
    first_launched=100.010,
    first_on_host=100.060,
    executor_published=100.061,
    detok_published=100.062,
)


def test_every_stage_is_the_gap_between_consecutive_stamps() -> None:
    stages = stage_ms(FirstToken(FULL, replied=100.063, handled=100.065))
    assert stages == {
        "tokenize": 2.0,
        "schedule": 1.0,
        "to_executor": 1.0,
        "queue": 6.0,
        "first_step": 50.0,
        "executor_publish": 1.0,
        "detokenize": 1.0,
        "to_gateway": 1.0,
        "gateway_handler": 2.0,
        "total": 65.0,
    }
    assert list(stages)[:-1] == [name for name, _, _ in STAGES]
    # the stages partition the total
    assert abs(sum(v for k, v in stages.items() if k != "total") - stages["total"]) < 1e-6


def test_a_stage_with_an_unrecorded_end_is_left_out() -> None:
    # a first token forced by a grammar has no step: no launch, no on-host stamp
    hops = HopTimes(gateway_received=1.0, tokenized=1.5, routed=2.0, executor_inbox=2.5)
    stages = stage_ms(FirstToken(hops, replied=0.0, handled=4.0))
    assert stages == {"tokenize": 500.0, "schedule": 500.0, "to_executor": 500.0, "total": 3000.0}


def test_medians_over_a_window_of_recent_requests() -> None:
    stats = HopStats(window=3)
    for ms in (10.0, 1.0, 2.0, 3.0):  # the first falls out of the window
        stats.add({"queue": ms, "total": 10 * ms})
    stats.add({"tokenize": 7.0})
    assert stats.summary() == {
        "requests": 5,
        "window": 3,
        "median_ms": {"tokenize": 7.0, "queue": 2.0, "total": 20.0},
    }
