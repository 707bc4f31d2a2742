"""Running the whole service stack with `radixserve serve`, as a user would."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import aiohttp
import msgspec
import redis

from radixserve.launcher import READY_MESSAGE
from shared import constants
from shared.messages.heartbeat import ExecutorLoad, Heartbeat
from tests.conftest import free_port

T = TypeVar("T")


@dataclass
class Stack:
    base_url: str
    proc: subprocess.Popen[bytes]
    log_path: Path
    redis_url: str | None  # None: serve runs its own private Redis
    ready_s: float
    grpc_target: str | None = None  # host:port of the gateway's gRPC server, when it has one

    def log_tail(self, n: int = 60) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-n:])

    def executor_loads(self) -> list[Heartbeat]:
        return self.heartbeats("executor")

    def heartbeats(self, service: str = "*") -> list[Heartbeat]:
        """The live instances' heartbeats (of `service`, or of every service)."""
        assert self.redis_url is not None
        r = redis.Redis.from_url(self.redis_url)
        try:
            keys = r.keys(f"{constants.LIVE_PREFIX}:{service}:*")
            dec = msgspec.msgpack.Decoder(Heartbeat)
            return [dec.decode(v) for v in r.mget(keys) if v is not None] if keys else []
        finally:
            r.close()

    def most_running_during(self, work: Callable[[], T]) -> tuple[T, int]:
        """work()'s result, and the most requests an executor's heartbeat reported running
        while it ran."""
        most = 0
        done = threading.Event()

        def watch() -> None:
            nonlocal most
            while not done.wait(0.05):
                for beat in self.executor_loads():
                    if beat.executor is not None:
                        most = max(most, beat.executor.running)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            result = work()
        finally:
            done.set()
            watcher.join()
        return result, most

    def wait_running(self, timeout: float = 20.0) -> Heartbeat:
        """Until an executor's heartbeat reports a request running."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for beat in self.executor_loads():
                if beat.executor is not None and beat.executor.running > 0:
                    return beat
            time.sleep(0.05)
        raise AssertionError(f"no executor reported a running request\n{self.log_tail()}")

    def wait_idle(
        self, timeout: float = 20.0, until: Callable[[ExecutorLoad], bool] = lambda _: True
    ) -> Heartbeat:
        """Until every executor reports no request, and every KV slot either free or cached
        and unlocked (nothing leaked, nothing still locked), and `until` holds of its load."""
        deadline = time.monotonic() + timeout
        last = None
        while time.monotonic() < deadline:
            beats = self.executor_loads()
            if beats:
                last = beats[0]
                load = last.executor
                assert load is not None
                if (
                    load.running == 0
                    and load.waiting == 0
                    and load.evictable_tokens == load.cached_tokens
                    and load.free_kv_tokens + load.cached_tokens == load.total_kv_tokens
                    and until(load)
                ):
                    return last
            time.sleep(0.1)
        raise AssertionError(f"executor not idle: {last}\n{self.log_tail()}")

    def stop(self) -> int:
        self.proc.send_signal(signal.SIGINT)
        try:
            return self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_tree(self.proc)
            raise AssertionError(f"serve did not stop on Ctrl-C\n{self.log_tail()}") from None


def descendants(pid: int) -> list[int]:
    """Every live process below `pid` (Linux /proc), children before their own children."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])  # the name in (...) may hold spaces
        children.setdefault(ppid, []).append(int(entry.name))
    found: list[int] = []
    todo = [pid]
    while todo:
        below = children.get(todo.pop(), [])
        found += below
        todo += below
    return found


def kill_tree(proc: subprocess.Popen[Any]) -> None:
    """SIGKILL serve and everything it started (services, its Redis, tensor-parallel ranks,
    some in sessions of their own): a serve that would not stop must not leave services
    running and retrying Redis into the next tests. Serve is stopped (SIGSTOP) first, so
    that its supervisor restarts nothing while its children are killed."""
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGSTOP)
    for pid in [*descendants(proc.pid), proc.pid]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


def with_sigint_ignored(command: list[str]) -> list[str]:
    """`command` run with SIGINT ignored, as a shell script's background job runs: a Python
    shim ignores it and execs the command, which keeps the disposition (and the pid)."""
    shim = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_IGN); "
    shim += "os.execv(sys.argv[1], sys.argv[1:])"
    return [sys.executable, "-c", shim, *command]


def start_stack(
    args: list[str],
    log_path: Path,
    redis_url: str | None,
    env: dict[str, str] | None = None,
    timeout: float = 300.0,
    grpc: bool = False,
    sigint_ignored: bool = False,
) -> Stack:
    """`radixserve serve` with `args`, once /health says it serves; with `grpc`, the gateway
    also serves gRPC on a free port (`Stack.grpc_target`). With `sigint_ignored`, serve starts
    with SIGINT ignored, as a shell script's background job (`radixserve serve &`) does."""
    port = free_port()
    grpc_port = free_port() if grpc else -1
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    full_env.pop("REDIS_URL", None)
    if redis_url is not None:
        full_env["REDIS_URL"] = redis_url
    full_env.update(env or {})
    log = open(log_path, "wb")  # noqa: SIM115 - the child writes it for the stack's lifetime
    started = time.monotonic()
    command = [
        *(sys.executable, "-m", "radixserve", "serve"),
        *("--port", str(port), "--grpc-port", str(grpc_port), *args),
    ]
    if sigint_ignored:
        command = with_sigint_ignored(command)
    proc = subprocess.Popen(
        command,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=full_env,
    )
    base = f"http://127.0.0.1:{port}"
    target = f"127.0.0.1:{grpc_port}" if grpc else None
    stack = Stack(base, proc, log_path, redis_url, 0.0, target)
    while time.monotonic() - started < timeout:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited with {proc.returncode}\n{stack.log_tail()}")
        if READY_MESSAGE in log_path.read_text(errors="replace"):
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
                    if resp.status == 200:
                        stack.ready_s = time.monotonic() - started
                        return stack
            except OSError:
                pass
        time.sleep(0.2)
    kill_tree(proc)
    raise AssertionError(f"serve not ready in {timeout}s\n{stack.log_tail()}")


async def sse_events(resp: aiohttp.ClientResponse) -> AsyncIterator[dict[str, Any]]:
    """A streamed OpenAI answer's events as they arrive (none may be an error event)."""
    async for raw in resp.content:
        line = raw.decode().strip()
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        event = json.loads(line[len("data: ") :])
        assert "error" not in event, event
        yield event
