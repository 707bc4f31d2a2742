"""The child processes `radixserve serve` runs: what each one is, and one life of it.

Every start of a child is a new incarnation with its own instance id,
`{service}-{i}.{incarnation}`, so a restarted service's heartbeat, streams and consumer name
never collide with what its dead predecessor left in Redis.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field


def die_with_parent() -> None:
    """In each child, before exec: get SIGTERM when the launcher dies, however it dies
    (Linux), so no service outlives `radixserve serve`."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


@dataclass(frozen=True)
class ChildSpec:
    name: str  # "{service}-{i}": stable across restarts
    service: str  # the liveness keys' service name
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)
    instance_suffix: str = ""  # set when the Redis is shared with other launches

    def instance(self, incarnation: int) -> str:
        return f"{self.name}.{incarnation}{self.instance_suffix}"


class Child:
    """One child and its current process; `start` begins the next incarnation."""

    def __init__(self, spec: ChildSpec) -> None:
        self.spec = spec
        self.incarnation = -1
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0
        self.restart_at: float | None = None  # when a scheduled restart is due

    @property
    def instance(self) -> str:
        return self.spec.instance(self.incarnation)

    def start(self) -> None:
        self.incarnation += 1
        env = {**self.spec.env, "RADIXSERVE_INSTANCE_ID": self.instance}
        self.proc = subprocess.Popen(self.spec.argv, env=env, preexec_fn=die_with_parent)
        self.started_at = time.monotonic()
        self.restart_at = None

    def exit_code(self) -> int | None:
        """The exit code of a process that has ended, None while it runs (or never ran)."""
        return None if self.proc is None else self.proc.poll()

    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


def stop_children(children: list[Child], timeout: float = 40.0) -> None:
    """SIGTERM in the given order (the gateway first: no new requests), then wait for all;
    SIGKILL whatever outlives `timeout`."""
    for c in children:
        if c.running():
            assert c.proc is not None
            c.proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
