"""Serve's side of the zygote (radixserve/zygote.py): starting it, asking it for a service,
and the process handle of a service it forked, which serve adopts as a child subreaper."""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterable

from radixserve.children import PRCTL, spawn
from radixserve.cli import COMMANDS

PR_SET_CHILD_SUBREAPER = 36
# The variables that may differ between serve's children and the zygote: everything else
# they share with it, since its imports read the environment (TRITON_INTERPRET, ...).
PER_CHILD_ENV = (
    "RADIXSERVE_INSTANCE_ID",
    # serve starts the zygote before its private Redis, whose address no import reads
    "REDIS_URL",
)


def shared_env(env: dict[str, str]) -> dict[str, str]:
    """What of a child's environment must equal the zygote's."""
    return {k: v for k, v in env.items() if k not in PER_CHILD_ENV}


def zygote_supported() -> bool:
    """Whether services can be forked and adopted here (Linux's prctl)."""
    return PRCTL is not None


def become_subreaper() -> bool:
    """Make this process adopt its descendants' orphans (Linux 3.4+); whether it did."""
    if PRCTL is None:
        return False
    return bool(PRCTL(PR_SET_CHILD_SUBREAPER, 1) == 0)


class AdoptedProcess:
    """A service the zygote forked and this process adopted: what serve uses of a Popen."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: nothing left to read
                self.returncode = -signal.SIGKILL
            else:
                if pid:
                    self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            pidfd = os.pidfd_open(self.pid)
        except (OSError, AttributeError):
            pidfd = -1  # the process is gone (or no pidfds here): poll
        try:
            while (code := self.poll()) is None:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise subprocess.TimeoutExpired([str(self.pid)], timeout or 0.0)
                if pidfd >= 0:  # readable once the process has exited
                    select.select([pidfd], [], [], left)
                else:
                    time.sleep(min(0.05, left) if left is not None else 0.05)
            return code
        finally:
            if pidfd >= 0:
                os.close(pidfd)

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:  # never a reused pid
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """The zygote process, started on the first request and again after it dies."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = shared_env(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.sock: socket.socket | None = None
        self._buffer = b""
        self.refused: str | None = None  # why the zygote forks nothing here, once it said so

    def accepts(self, argv: list[str], env: dict[str, str]) -> bool:
        """Whether a child is one the zygote can fork: a `radixserve <service>` command with
        the environment the zygote imported under."""
        return (
            argv[:3] == [sys.executable, "-m", "radixserve"]
            and len(argv) > 3
            and argv[3] in COMMANDS
            and argv[3] != "serve"
            and shared_env(env) == self.env
        )

    def spawn(self, argv: list[str], env: dict[str, str]) -> AdoptedProcess | None:
        """The service forked by the zygote, or None if the zygote could not fork it (serve
        then starts it itself)."""
        if self.refused is not None:
            return None
        self.start()
        assert self.sock is not None and self.proc is not None
        try:
            self.sock.sendall(json.dumps({"argv": argv, "env": env}).encode() + b"\n")
            answer = self._read_line()
        except OSError:
            answer = None
        if answer is not None and "refuse" in answer:
            self.refused = str(answer["refuse"])
            print(
                f"radixserve serve: each service starts from its command: {self.refused}",
                file=sys.stderr,
                flush=True,
            )
            self.close()
            return None
        if answer is None or "pid" not in answer:
            self.close()  # a zygote that failed once is started again for the next child
            return None
        return AdoptedProcess(int(str(answer["pid"])))

    def start(self) -> None:
        """Start the zygote unless it runs: it imports while serve goes on, and answers the
        first request once it has."""
        if self.running():
            return
        self.close()
        ours, theirs = socket.socketpair()
        self.proc = spawn(
            [sys.executable, "-m", "radixserve.zygote", str(theirs.fileno())],
            self.env,
            pass_fds=(theirs.fileno(),),
        )
        theirs.close()
        self.sock = ours
        self._buffer = b""

    def _read_line(self) -> dict[str, object] | None:
        """The zygote's answer; None if it died first. It answers once it has imported, which
        on a loaded machine can take a while: its exit, not a timeout, ends the wait."""
        assert self.sock is not None and self.proc is not None
        while b"\n" not in self._buffer:
            readable, _, _ = select.select([self.sock], [], [], 1.0)
            if not readable:
                if self.proc.poll() is not None:
                    return None
                continue
            chunk = self.sock.recv(65536)
            if not chunk:
                return None
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        answer: dict[str, object] = json.loads(line)
        return answer

    def running(self) -> bool:
        """Whether the zygote runs (reaping it if it died)."""
        return self.proc is not None and self.proc.poll() is None

    def close(self) -> None:
        """Stop the zygote (closing its socket ends it); the services it forked run on."""
        if self.sock is not None:
            self.sock.close()
            self.sock = None
        if self.proc is not None:
            if self.proc.poll() is None:
                self.proc.terminate()
            self.proc.wait()
            self.proc = None


def reap_orphans(known: Iterable[int]) -> list[int]:
    """Reap the exited children this subreaper adopted and nothing else waits for (a
    service's own child whose parent died first); `known` are the pids whose owners reap them
    (Popen objects, adopted services). The pids reaped."""
    keep = set(known)
    reaped = []
    while True:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            break
        if info is None or info.si_pid in keep:
            break  # nothing exited, or its owner reaps it at its next poll
        os.waitpid(info.si_pid, 0)
        reaped.append(info.si_pid)
    return reaped
