"""`radixserve serve` stops on Ctrl-C whatever signal dispositions it inherited: a shell
script's background job (`radixserve serve &`) starts with SIGINT ignored, and Python then
raises no KeyboardInterrupt for it."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.stack import descendants, kill_tree, start_stack, with_sigint_ignored

pytestmark = [pytest.mark.slow]


def test_serve_started_with_sigint_ignored_stops_on_sigint(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    stack = start_stack(
        ["--model", str(tiny_model_dir), "--max-total-tokens", "2048"],
        tmp_path / "serve.log",
        None,  # serve's own Redis
        sigint_ignored=True,
    )
    assert stack.stop() == 0, stack.log_tail()  # SIGINT, then up to 60 s
    assert stack.log_tail().rstrip().endswith("radixserve serve: stopped"), stack.log_tail()


def test_services_of_a_sigkilled_serve_stop_without_draining(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """serve SIGKILLed (no handler runs): the kernel sends each service SIGTERM
    (PR_SET_PDEATHSIG), and, their launcher gone with its private Redis, they stop without
    draining for up to 10-35 s against a Redis that is not coming back (an executor took 39 s
    that way, holding its memory in the next start's way)."""
    stack = start_stack(
        ["--model", str(tiny_model_dir), "--max-total-tokens", "2048"],
        tmp_path / "serve.log",
        None,  # serve's own Redis
    )
    services = descendants(stack.proc.pid)
    assert services
    seen = len(stack.log_path.read_text(errors="replace"))
    stack.proc.kill()
    stack.proc.wait()
    deadline = time.monotonic() + 60
    while any(_alive(pid) for pid in services):
        assert time.monotonic() < deadline, [p for p in services if _alive(p)]
        time.sleep(0.05)
    after = stack.log_path.read_text(errors="replace")[seen:]
    assert "the launcher is gone; not draining" in after, after
    assert "draining for up to" not in after, after  # no service drained


def test_the_harness_starts_serve_with_sigint_ignored(tmp_path: Path) -> None:
    """What the test above relies on: the command runs with SIGINT ignored (here a Python
    that prints the disposition it was given)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    command = with_sigint_ignored([sys.executable, "-c", probe])
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_kill_tree_reaches_children_in_their_own_sessions() -> None:
    """A serve that does not stop is killed with what it started: here a parent that keeps
    a child and a grandchild in a session of its own (as serve starts its Redis) and prints
    their pids once both exist."""
    script = (
        "import subprocess, sys, time\n"
        "grand = 'import subprocess, sys, time; "
        'p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]); '
        "print(p.pid, flush=True); time.sleep(600)'\n"
        "c = subprocess.Popen([sys.executable, '-c', grand], stdout=subprocess.PIPE,"
        " start_new_session=True, text=True)\n"
        "print(c.pid, c.stdout.readline().strip(), flush=True)\n"
        "time.sleep(600)\n"
    )
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    pids = [int(p) for p in parent.stdout.readline().split()]
    assert len(pids) == 2 and set(pids) <= set(descendants(parent.pid))
    kill_tree(parent)
    assert parent.returncode == -signal.SIGKILL
    for pid in pids:  # killed; reaped by init once orphaned, so wait until /proc drops them
        deadline = time.monotonic() + 10
        while _alive(pid):
            assert time.monotonic() < deadline, f"pid {pid} still alive"
            time.sleep(0.02)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie is dead, waiting for its parent to reap it
