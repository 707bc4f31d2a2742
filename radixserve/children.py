"""The child processes `radixserve serve` runs: what each one is, and one life of it.

Every start of a child is a new incarnation with its own instance id,
`{service}-{i}.{incarnation}`, so a restarted service's heartbeat, streams and consumer name
never collide with what its dead predecessor left in Redis.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from shared.launcher import started_by

if TYPE_CHECKING:
    from radixserve.spawner import AdoptedProcess, Zygote

PR_SET_PDEATHSIG = 1


def _load_prctl() -> Callable[..., Any] | None:
    """libc's prctl, looked up once in the parent: between fork and exec a child of a
    process with threads must not import or dlopen anything (another thread may have held
    the loader's or the allocator's lock at the fork, which the child then waits on or
    aborts over)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl: Callable[..., Any] = ctypes.CDLL(None, use_errno=True).prctl
        return prctl
    except (OSError, AttributeError):
        return None


PRCTL = _load_prctl()


def die_with_parent() -> None:
    """In each child, before exec: get SIGTERM when the launcher dies, however it dies
    (Linux), so no service outlives `radixserve serve`. One call of the function the parent
    looked up: nothing is imported or loaded after the fork."""
    if PRCTL is not None:
        PRCTL(PR_SET_PDEATHSIG, signal.SIGTERM)


# A Python child started without a preexec_fn arms die_with_parent itself, first thing after
# exec (`arm_parent_death`), given its launcher's pid here.
PARENT_ENV = "RADIXSERVE_DIE_WITH_PARENT"


def arm_parent_death() -> None:
    """In a child started with PARENT_ENV: `die_with`, its launcher. The variable is removed,
    so that this process's own children do not compare against its parent."""
    parent = os.environ.pop(PARENT_ENV, None)
    if parent is not None:
        die_with(int(parent))


def die_with(launcher: int) -> None:
    """In a service whose parent is `launcher` (serve, an Engine): die_with_parent, then exit at
    once if the launcher is already gone (it died before the signal was armed); else record
    it (shared/launcher.py)."""
    die_with_parent()
    if os.getppid() != launcher:
        os._exit(0)
    started_by(launcher)


def spawn(
    argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...] = ()
) -> subprocess.Popen[bytes]:
    """Start a Python child that runs arm_parent_death first (`python -m radixserve ...`,
    the zygote). Without a preexec_fn, Popen starts it with vfork and exec: a preexec_fn
    makes it fork and run the interpreter in the child before exec, which in a process with
    threads (an Engine in an application's process; a test worker holding gRPC's threads)
    runs every library's at-fork handlers there, and one of them can kill or hang the child
    before it ever starts (seen: a service that never wrote its first line, restarted)."""
    return subprocess.Popen(argv, env={**env, PARENT_ENV: str(os.getpid())}, pass_fds=pass_fds)


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
        self.proc: subprocess.Popen[bytes] | AdoptedProcess | None = None
        self.started_at = 0.0
        self.restart_at: float | None = None  # when a scheduled restart is due

    @property
    def instance(self) -> str:
        return self.spec.instance(self.incarnation)

    def start(self, zygote: Zygote | None = None) -> None:
        """Forked by `zygote` where it can, else started from its command."""
        self.incarnation += 1
        env = {**self.spec.env, "RADIXSERVE_INSTANCE_ID": self.instance}
        self.proc = None
        if zygote is not None and zygote.accepts(self.spec.argv, env):
            self.proc = zygote.spawn(self.spec.argv, env)
        if self.proc is None:
            self.proc = spawn(self.spec.argv, env)
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
