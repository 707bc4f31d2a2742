"""shared/launcher.py and the stop it changes: a service whose launcher died does not drain
(tests/e2e/test_stop_signals.py kills a whole serve that way)."""

from __future__ import annotations

import os

import pytest

from shared import launcher
from shared.service import Service


def test_only_a_recorded_launcher_can_be_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_launcher", None)
    monkeypatch.setattr(os, "getppid", lambda: 1)
    assert not launcher.launcher_gone()  # started by a shell or compose: never gone
    launcher.started_by(4242)
    assert launcher.launcher_gone()
    monkeypatch.setattr(os, "getppid", lambda: 4242)
    assert not launcher.launcher_gone()


async def test_stop_drains_unless_the_launcher_is_gone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(launcher, "_launcher", 4242)
    for parent, drain in ((4242, 30.0), (1, 0.0)):
        monkeypatch.setattr(os, "getppid", lambda parent=parent: parent)
        svc = Service("test", "t1", "redis://127.0.0.1:1/0", drain_timeout_s=30.0)
        svc.stop()
        assert svc.stopping.is_set() and svc.drain_timeout_s == drain
        await svc.r.aclose()
