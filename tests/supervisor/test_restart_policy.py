"""The restart policy: backoff doubling to a cap, reset after a healthy run, a limit."""

from __future__ import annotations

from radixserve.restart import GiveUp, Restart, RestartPolicy, RestartTracker


def test_backoff_doubles_from_half_a_second_to_thirty() -> None:
    t = RestartTracker(RestartPolicy(max_restarts=100, window_s=1.0))
    delays = []
    now = 0.0
    for _ in range(9):
        d = t.on_exit(now, started_at=now - 1.0)
        assert isinstance(d, Restart)
        delays.append(d.delay_s)
        now += 10.0  # outside the window: only the backoff is under test
    assert delays == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]


def test_a_healthy_run_resets_the_backoff() -> None:
    t = RestartTracker(RestartPolicy())
    assert t.on_exit(10.0, started_at=9.0) == Restart(0.5)
    assert t.on_exit(20.0, started_at=19.0) == Restart(1.0)
    assert t.on_exit(100.0, started_at=20.0) == Restart(0.5)  # it ran 80 s: healthy


def test_the_limit_counts_restarts_within_the_window() -> None:
    t = RestartTracker(RestartPolicy(max_restarts=3, window_s=300.0))
    for now in (0.0, 100.0, 200.0):
        assert isinstance(t.on_exit(now, started_at=now - 70.0), Restart)
    stop = t.on_exit(250.0, started_at=240.0)
    assert isinstance(stop, GiveUp) and "3 restarts within 300s" in stop.reason
    # The first restart has left the window: one more is allowed.
    assert isinstance(t.on_exit(301.0, started_at=290.0), Restart)


def test_no_restarts_allowed_gives_up_at_once() -> None:
    assert isinstance(RestartTracker(RestartPolicy(max_restarts=0)).on_exit(5.0, 0.0), GiveUp)
