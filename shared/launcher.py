"""Whether the launcher that started this process (`radixserve serve`, an Engine) is gone.

radixserve/children.py and the zygote record the launcher's pid first thing in each service
they start; a process started any other way (compose, a shell) has none, and its launcher is
never gone.
"""

from __future__ import annotations

import os

_launcher: int | None = None


def started_by(pid: int) -> None:
    """Record `pid` as this process's launcher (its parent when called)."""
    global _launcher
    _launcher = pid


def launcher_gone() -> bool:
    """True once the recorded launcher has died: this process was reparented."""
    return _launcher is not None and os.getppid() != _launcher
