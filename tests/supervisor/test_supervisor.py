"""The real supervisor over cheap fake children (tests/supervisor/fake_child.py): restarts
with backoff and fresh instance ids, the restart limit, a death before readiness, and the
private redis-server restarted on the same socket and password."""

from __future__ import annotations

import itertools
import os
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis

from radixserve.children import ChildSpec
from radixserve.redis_proc import RedisServer
from radixserve.restart import RestartPolicy
from radixserve.supervisor import Supervisor
from shared import constants

ROOT = Path(__file__).resolve().parents[2]
FAKE = str(Path(__file__).with_name("fake_child.py"))
pytestmark = pytest.mark.redis


def spec(name: str, mode: str, tmp: Path, redis_url: str) -> ChildSpec:
    env = {
        **os.environ,
        "PYTHONPATH": str(ROOT),
        "REDIS_URL": redis_url,
        "FAKE_MODE": mode,
        "FAKE_LOG": str(tmp / f"{name}.log"),
        "FAKE_GO": str(tmp / "go"),
    }
    return ChildSpec(name, "fake", [sys.executable, FAKE], env)


def starts(tmp: Path, name: str) -> list[tuple[str, float]]:
    lines = (tmp / f"{name}.log").read_text().splitlines()
    return [(line.split()[0], float(line.split()[1])) for line in lines]


def test_a_dying_child_is_restarted_with_backoff_until_the_limit(
    tmp_path: Path, redis_url: str, redis_sync: redis.Redis, capsys: pytest.CaptureFixture[str]
) -> None:
    def ready() -> bool:  # the stack is ready: let the dying child die
        (tmp_path / "go").touch()
        return True

    policy = RestartPolicy(initial_delay_s=0.1, max_delay_s=0.4, max_restarts=3, window_s=60)
    sup = Supervisor(
        [spec("fake-0", "die", tmp_path, redis_url), spec("steady-0", "run", tmp_path, redis_url)],
        redis_url,
        is_ready=ready,
        policy=policy,
    )
    assert sup.run() == 1
    runs = starts(tmp_path, "fake-0")
    # One start and three restarts, each a fresh incarnation.
    assert [i for i, _ in runs] == ["fake-0.0", "fake-0.1", "fake-0.2", "fake-0.3"]
    gaps = [b[1] - a[1] for a, b in itertools.pairwise(runs)]
    assert all(gap >= delay for gap, delay in zip(gaps, (0.1, 0.2, 0.4), strict=True)), gaps
    err = capsys.readouterr().err
    assert "fake-0 (fake-0.0) exited with code 3; restarting it in 0.1s" in err
    assert "not restarting it again: 3 restarts within 60s (--max-restarts)" in err
    # Each dead incarnation's liveness key went with it; the steady child was stopped too.
    assert not any(redis_sync.exists(constants.live_key("fake", i)) for i, _ in runs), (
        redis_sync.keys()
    )
    assert [i for i, _ in starts(tmp_path, "steady-0")] == ["steady-0.0"]
    assert all(c.exit_code() is not None for c in sup.children)


def test_a_child_dying_before_the_stack_is_ready_stops_everything(
    tmp_path: Path, redis_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    (tmp_path / "go").touch()  # it dies at once
    sup = Supervisor(
        [spec("fake-0", "die", tmp_path, redis_url), spec("steady-0", "run", tmp_path, redis_url)],
        redis_url,
        is_ready=lambda: False,
    )
    assert sup.run() == 1
    assert [i for i, _ in starts(tmp_path, "fake-0")] == ["fake-0.0"]  # never restarted
    assert "fake-0 (fake-0.0) exited with code 3 before the stack was ready" in (
        capsys.readouterr().err
    )
    assert all(c.exit_code() is not None for c in sup.children)


def test_the_private_redis_is_private_and_restarted_on_the_same_socket(tmp_path: Path) -> None:
    server = RedisServer()
    server.start()
    assert stat.S_IMODE(os.stat(server.workdir).st_mode) == 0o700
    with pytest.raises(redis.AuthenticationError):  # no password, no access
        redis.Redis(unix_socket_path=server.socket).ping()
    client = redis.Redis.from_url(server.url)
    assert client.ping()
    ready = threading.Event()
    sup = Supervisor([], server.url, is_ready=lambda: True, on_ready=ready.set, redis_server=server)
    result: list[int] = []
    thread = threading.Thread(target=lambda: result.append(sup.run()))
    thread.start()
    try:
        # Killed before the supervisor saw the stack ready, it would stop everything instead
        # (a death before ready is a failed start): wait for that first.
        assert ready.wait(30), "the supervisor never saw the stack ready"
        first = server.proc
        assert first is not None
        first.send_signal(signal.SIGKILL)
        deadline = time.monotonic() + 30  # a loaded 2-core machine restarts it slower
        while server.proc is first or server.exit_code() is not None:
            assert time.monotonic() < deadline, "redis-server was not restarted"
            time.sleep(0.05)
        # The same URL, password included, reaches the new server.
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "the restarted redis-server is unreachable"
                time.sleep(0.05)
    finally:
        sup.request_stop()
        thread.join(timeout=20)
        client.close()
    assert result == [0] and server.exit_code() is not None
    assert not os.path.exists(server.workdir)


_PARENT = """
import subprocess, sys, time
from radixserve.children import die_with_parent
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"],
                         preexec_fn=die_with_parent)
print(child.pid, flush=True)
time.sleep(120)
"""


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_dies_with_its_killed_parent() -> None:
    """The launcher SIGKILLed (no handler runs): its children get SIGTERM from the kernel,
    through the prctl looked up before the fork."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    parent = subprocess.Popen(
        [sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True, env=env
    )
    assert parent.stdout is not None
    _dies_with(parent, int(parent.stdout.readline()))


def _dies_with(parent: subprocess.Popen[str], child: int) -> None:
    """SIGKILL `parent`; `child` (running) must end within 30 s."""
    assert _running(child)
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 30
    while _running(child) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _running(child), "the child outlived its SIGKILLed parent"


_SPAWNING_PARENT = """
import os, sys, time
from radixserve.children import spawn
armed = sys.argv[1]
code = (
    "import os, sys, time; from radixserve.children import arm_parent_death; arm_parent_death(); "
    "open(sys.argv[1], 'w').write(repr(os.environ.get('RADIXSERVE_DIE_WITH_PARENT'))); "
    "time.sleep(120)"
)
child = spawn([sys.executable, "-c", code, armed], dict(os.environ))
print(child.pid, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_started_without_preexec_arms_its_parents_death_itself(tmp_path: Path) -> None:
    """children.spawn starts a child without a preexec_fn (so nothing runs between fork and
    exec); the child arms the signal first thing, and removes the variable that told it its
    parent, so that its own children do not take the wrong one."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    armed = tmp_path / "armed"
    parent = subprocess.Popen(
        [sys.executable, "-c", _SPAWNING_PARENT, str(armed)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    deadline = time.monotonic() + 60
    while not (armed.exists() and armed.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert armed.read_text() == "None"  # the variable is gone from the child's environment
    _dies_with(parent, child)


def test_a_child_whose_parent_is_already_gone_exits_before_running() -> None:
    """The launcher died between the child's start and its arming: the child's parent is no
    longer the one named, so it exits at once, running nothing."""
    code = "from radixserve.children import arm_parent_death; arm_parent_death(); print('ran')"
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RADIXSERVE_DIE_WITH_PARENT": "1"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert (done.returncode, done.stdout) == (0, ""), done.stderr
