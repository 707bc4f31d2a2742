"""A stack to break: a redis-server on a fixed port (so it can be stopped and started again on
the same address), `radixserve serve` using it, optional extra executors, and SIGKILL for any
one service process.

Used by tests/faults and `radixserve-loadtest faults`. Processes are found through /proc (the
serve process's children and their command lines), so this runs on Linux only, as the
supervisor's own parent-death signal does.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from radixserve.launcher import READY_MESSAGE

# The services as `radixserve <service>` names them in a child's command line.
SERVICES = ("gateway", "tokenizer", "grammar", "scheduler", "executor", "detokenizer")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(condition: object, timeout: float, what: str, step: float = 0.1) -> float:
    """Poll condition() until true; the seconds it took. Raises TimeoutError naming `what`."""
    started = time.monotonic()
    while time.monotonic() - started < timeout:
        if condition():  # type: ignore[operator]
            return time.monotonic() - started
        time.sleep(step)
    raise TimeoutError(f"{what} not within {timeout:.0f}s")


class RedisServer:
    """A redis-server this process owns, on one port for its whole life."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.workdir = tempfile.mkdtemp(prefix="rs-faults-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self.workdir]
        self.proc = subprocess.Popen(
            [binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        wait_for(self.answers, timeout, f"redis-server on port {self.port}", 0.05)

    def answers(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(16).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self) -> None:
        """SIGKILL: the data is gone, as after a crash (persistence is off)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


def children(pid: int) -> list[int]:
    found: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    try:
        for task in task_dir.iterdir():
            text = (task / "children").read_text()
            found += [int(c) for c in text.split()]
    except OSError:
        pass
    return found


def cmdline(pid: int) -> list[str]:
    """A process's command line, word by word. A service forked by serve's zygote shows its
    command as one title string (radixserve/zygote.py), so the words are split on spaces too."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return []
    return [w for a in raw.split(b"\0") for w in a.decode(errors="replace").split(" ") if w]


def tree_cpu(root: int, name_of: Callable[[int, list[str]], str]) -> dict[str, float]:
    """CPU seconds (user + system) of `root` and its live descendants, summed by
    name_of(pid, command words)."""
    tick = os.sysconf("SC_CLK_TCK")
    parents: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            raw = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = raw[raw.rindex(")") + 2 :].split()
        parents[int(entry)] = int(fields[1])
        cpu[int(entry)] = (int(fields[11]) + int(fields[12])) / tick
    out: dict[str, float] = {}
    for pid, seconds in cpu.items():
        p = pid
        while p not in (0, 1, root) and p in parents:
            p = parents[p]
        if p == root:
            name = name_of(pid, cmdline(pid))
            out[name] = out.get(name, 0.0) + seconds
    return out


def service_of(cmdline: list[str]) -> str | None:
    """'executor' for `python -m radixserve executor ...`, None for anything else."""
    for i, arg in enumerate(cmdline[:-1]):
        if arg == "radixserve" and cmdline[i + 1] in SERVICES:
            return cmdline[i + 1]
    return None


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped


@dataclass
class Stack:
    """`radixserve serve` on a RedisServer, plus extra executor processes."""

    redis: RedisServer
    serve_args: list[str]
    log_dir: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    extra: list[subprocess.Popen[bytes]] = field(default_factory=list)
    log_start: int = 0  # where the current serve's lines begin in serve.log

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.log_dir / "serve.log"

    def env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
        env["REDIS_URL"] = self.redis.url
        env["PYTHONUNBUFFERED"] = "1"
        return env

    def start(self, timeout: float = 300.0) -> float:
        """Start serve and wait until /health is 200; the seconds it took."""
        self.log_dir.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "ab")  # noqa: SIM115 - serve writes it for its lifetime
        self.log_start = log.tell()  # this start's lines begin here (the log is appended to)
        cmd = [sys.executable, "-m", "radixserve", "serve", "--port", str(self.port)]
        # Its own session: stop() can end serve and every child with one signal.
        self.proc = subprocess.Popen(
            [*cmd, *self.serve_args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        return self.wait_healthy(timeout)

    def add_executor(self, args: list[str]) -> subprocess.Popen[bytes]:
        """One more executor on the same bus (serve starts one); stop() ends it too."""
        log = open(self.log_dir / f"executor-{len(self.extra) + 1}.log", "ab")  # noqa: SIM115
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "executor", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=self.env(),
            start_new_session=True,
        )
        self.extra.append(proc)
        return proc

    def live_instances(self, service: str) -> int:
        """Instances of `service` with a fresh heartbeat, as GET /health counts them."""
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                body = resp.read()
        except urllib.error.HTTPError as e:  # 503 while a stage is missing: counts still given
            body = e.read()
        except (urllib.error.URLError, OSError):
            return 0
        try:
            return int(json.loads(body)["instances"][service])
        except (ValueError, KeyError, TypeError):
            return 0

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.base_url}/health", timeout=2) as resp:
                return bool(resp.status == 200)
        except (urllib.error.URLError, OSError):
            return False

    def serve_ready(self) -> bool:
        """Whether serve has said it serves: until then it treats a child's exit as a failed
        start and stops everything, so a fault injected between /health's first 200 and this
        line stopped the stack (2 runs in 12 of the supervisor test)."""
        try:
            with open(self.log_path, "rb") as log:
                log.seek(self.log_start)
                return READY_MESSAGE.encode() in log.read()
        except OSError:
            return False

    def wait_healthy(self, timeout: float) -> float:
        def ready() -> bool:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"serve exited with {self.proc.returncode}\n{self.log_tail()}")
            return self.healthy() and self.serve_ready()

        try:
            return wait_for(ready, timeout, "GET /health 200 and serve ready", 0.2)
        except TimeoutError as e:
            raise TimeoutError(f"{e}\n{self.log_tail()}") from None

    def pids(self, service: str) -> list[int]:
        """Live processes of one service: serve's children and the extra executors."""
        if self.proc is None:
            return []
        candidates = children(self.proc.pid) + [p.pid for p in self.extra if p.poll() is None]
        return [p for p in candidates if _alive(p) and service_of(cmdline(p)) == service]

    def kill(self, service: str, index: int = 0) -> int:
        """SIGKILL one process of service; its pid."""
        pids = self.pids(service)
        if len(pids) <= index:
            raise RuntimeError(f"no live {service} process #{index} (have {pids})")
        pid = sorted(pids)[index]
        os.kill(pid, signal.SIGKILL)
        return pid

    def wait_replaced(self, service: str, old: int, timeout: float) -> float:
        """Until a live process of service other than old runs; the seconds it took."""
        return wait_for(
            lambda: any(p != old for p in self.pids(service)), timeout, f"a new {service}"
        )

    def serve_alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def log_tail(self, n: int = 40) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, timeout: float = 30.0) -> int | None:
        """SIGTERM serve (it stops its children), then SIGKILL whatever of its session is left.
        Serve's exit code, None if it had to be killed."""
        code = None
        for proc in [*self.extra, self.proc]:
            if proc is None:
                continue
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                code = proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                code = None
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # anything of its session still alive
            proc.wait()
        self.proc, self.extra = None, []
        return code
