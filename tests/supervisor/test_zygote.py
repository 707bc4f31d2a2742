"""Services forked by the zygote (radixserve/zygote.py) behave as the ones serve starts from
their commands: real `radixserve scheduler` processes on a real Redis, forked from a driver
process that plays serve (tests/supervisor/zygote_driver.py): the adopter's children, under
their own command and instance id, with their exit codes, dying with it, and living on when
the zygote dies."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from radixserve.spawner import Zygote
from shared import constants

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="a Linux subreaper"),
]


class Driver:
    def __init__(self, redis_url: str, stderr: Path, **extra_env: str) -> None:
        env = {**os.environ, "PYTHONPATH": str(ROOT), "REDIS_URL": redis_url, **extra_env}
        env = {k: v for k, v in env.items() if k != "RADIXSERVE_INSTANCE_ID"}
        self.stderr = stderr  # the driver's, the zygote's and the services' (they inherit it)
        with open(stderr, "wb") as err:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "tests.supervisor.zygote_driver"],
                cwd=ROOT,
                env=env,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=err,
                text=True,
            )

    def ask(self, line: str) -> dict[str, object]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        assert answer, f"the driver exited ({self.proc.wait()}) on {line!r}"
        out: dict[str, object] = json.loads(answer)
        return out

    def spawn(self, instance: str, *argv: str) -> int:
        return int(str(self.ask(f"spawn {instance} {' '.join(argv)}")["pid"]))

    def close(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            self.proc.stdin.close()
            self.proc.wait(60)


@pytest.fixture(scope="module")
def drivers() -> Iterator[list[Driver]]:
    started: list[Driver] = []
    yield started
    for d in started:
        d.close()


@pytest.fixture
def driver(
    drivers: list[Driver], redis_url: str, tmp_path_factory: pytest.TempPathFactory
) -> Driver:
    """The module's driver while it lives (its zygote imports for seconds of CPU), else a new
    one: a test may kill it."""
    if not drivers or drivers[-1].proc.poll() is not None:
        log = tmp_path_factory.mktemp("zygote") / "stderr.log"
        drivers.append(Driver(redis_url, log))
    return drivers[-1]


def wait_until(check: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, f"{what}: not within {timeout}s"
        time.sleep(0.05)


def stat(pid: int) -> tuple[str, int]:
    """(state, parent pid); ("", 0) once the process is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return "", 0
    return fields[0], int(fields[1])


def running(pid: int) -> bool:
    return stat(pid)[0] not in ("", "Z")


def live(r: redis.Redis, instance: str) -> bool:
    return bool(r.exists(constants.live_key("scheduler", instance)))


def test_a_forked_service_is_the_adopters_child_under_its_command_and_instance(
    driver: Driver, redis_url: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    pid = driver.spawn("zy-a", "scheduler", "--log-level", "warning")
    wait_until(lambda: live(r, "zy-a"), "the scheduler's liveness key")  # its env took
    assert stat(pid)[1] == driver.proc.pid
    title = Path(f"/proc/{pid}/cmdline").read_bytes().rstrip(b"\0").decode()
    assert title == f"{sys.executable} -m radixserve scheduler --log-level warning"
    zygote = int(str(driver.ask("zygote")["pid"]))
    assert zygote != pid and stat(zygote)[1] == driver.proc.pid
    driver.ask(f"signal {pid} {int(signal.SIGTERM)}")
    assert driver.ask(f"wait {pid}") == {"code": 0}  # drained and stopped, as on Ctrl-C
    assert not live(r, "zy-a")
    # It carries triton (the zygote imported it) and a frozen heap, yet stops without a
    # page of nanobind "leaked" warnings: it skips the interpreter's teardown.
    assert "nanobind" not in driver.stderr.read_text(errors="replace")


def test_exit_codes_reach_the_adopter(driver: Driver) -> None:
    bad = driver.spawn("zy-b", "scheduler", "--no-such-flag")
    assert driver.ask(f"wait {bad}") == {"code": 2}  # argparse's
    pid = driver.spawn("zy-c", "scheduler")
    driver.ask(f"signal {pid} {int(signal.SIGKILL)}")
    assert driver.ask(f"wait {pid}") == {"code": -signal.SIGKILL}


def test_services_outlive_a_killed_zygote_and_a_new_one_forks_the_next(
    driver: Driver, redis_url: str
) -> None:
    r = redis.Redis.from_url(redis_url)
    first = driver.spawn("zy-d", "scheduler")
    wait_until(lambda: live(r, "zy-d"), "the first scheduler")
    zygote = int(str(driver.ask("zygote")["pid"]))
    os.kill(zygote, signal.SIGKILL)
    wait_until(lambda: stat(zygote)[0] in ("", "Z"), "the zygote's death")
    second = driver.spawn("zy-e", "scheduler")
    wait_until(lambda: live(r, "zy-e"), "the second scheduler")
    assert running(first) and stat(second)[1] == driver.proc.pid
    assert int(str(driver.ask("zygote")["pid"])) != zygote


def test_orphans_are_reaped_and_pids_with_owners_are_left(driver: Driver) -> None:
    owned = driver.spawn("zy-g", "scheduler", "--no-such-flag")  # exits 2, not yet waited for
    wait_until(lambda: stat(owned)[0] == "Z", "the owned child's exit")
    orphan = int(str(driver.ask("orphan")["pid"]))
    assert stat(orphan)[1] == driver.proc.pid  # adopted
    os.kill(orphan, signal.SIGKILL)
    wait_until(lambda: stat(orphan)[0] == "Z", "the orphan's exit")
    # The owned zombie may stop the first pass (its owner reaps it); never is it reaped here.
    first = driver.ask(f"reap {owned}")["reaped"]
    assert stat(owned)[0] == "Z"
    assert driver.ask(f"wait {owned}") == {"code": 2}
    second = driver.ask(f"reap {owned}")["reaped"]
    assert [*first, *second] == [orphan]  # type: ignore[misc]
    assert stat(orphan)[0] == ""


def test_services_die_with_their_killed_adopter(driver: Driver, redis_url: str) -> None:
    r = redis.Redis.from_url(redis_url)
    pid = driver.spawn("zy-f", "scheduler")
    wait_until(lambda: live(r, "zy-f"), "the scheduler")
    driver.proc.kill()  # SIGKILL: nothing of the driver runs, the kernel's signal does
    driver.proc.wait()
    wait_until(lambda: not running(pid), "the scheduler's exit after its adopter's death")


def test_only_radixserve_services_under_the_zygotes_environment_are_forked() -> None:
    env = {"PATH": "/bin", "RADIXSERVE_MODEL": "m"}
    z = Zygote({**env, "RADIXSERVE_INSTANCE_ID": "ignored"})
    python = [sys.executable, "-m", "radixserve"]
    assert z.accepts([*python, "tokenizer"], {**env, "RADIXSERVE_INSTANCE_ID": "tokenizer-0.1"})
    assert not z.accepts([*python, "serve"], env)
    assert not z.accepts([*python, "no-such-service"], env)
    assert not z.accepts([sys.executable, "fake_child.py"], env)
    assert not z.accepts([*python, "tokenizer"], {**env, "RADIXSERVE_MODEL": "other"})


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="OpenBLAS starts no pool on one core")
def test_a_zygote_with_threads_forks_nothing_and_says_why(redis_url: str, tmp_path: Path) -> None:
    """A user's OPENBLAS_NUM_THREADS, kept, lets numpy start a pool thread at import: forking
    that process is unsafe, so the zygote refuses and serve starts each service itself."""
    driver = Driver(redis_url, tmp_path / "stderr.log", OPENBLAS_NUM_THREADS="2")
    try:
        answer = driver.ask("spawn zy-h scheduler")
        assert answer["pid"] is None
        assert "threads after importing" in str(answer["refused"]), answer
    finally:
        driver.close()
