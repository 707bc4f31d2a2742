"""`radixserve serve` stops on Ctrl-C whatever signal dispositions it inherited: a shell
script's background job (`radixserve serve &`) starts with SIGINT ignored, and Python then
raises no KeyboardInterrupt for it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.stack import start_stack, with_sigint_ignored

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


def test_the_harness_starts_serve_with_sigint_ignored(tmp_path: Path) -> None:
    """What the test above relies on: the command runs with SIGINT ignored (here a Python
    that prints the disposition it was given)."""
    probe = "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"
    command = with_sigint_ignored([sys.executable, "-c", probe])
    out = subprocess.run(command, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
