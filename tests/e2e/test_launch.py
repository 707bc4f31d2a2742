"""Start-up paths: compose.yaml's commands are real entry points; bad models fail clearly."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis
import yaml

from radixserve.cli import COMMANDS
from shared import constants

ROOT = Path(__file__).resolve().parents[2]
pytestmark = [pytest.mark.redis, pytest.mark.slow]


def compose_commands() -> dict[str, list[str]]:
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    return {
        name: svc["command"]
        for name, svc in spec["services"].items()
        if svc.get("image") == "radixserve:latest"  # not Redis, nor the monitoring tools
    }


def test_compose_has_every_service() -> None:
    cmds = compose_commands()
    assert {c[0] for c in cmds.values()} == set(COMMANDS) - {"serve"}


def test_every_compose_command_starts_and_stops_on_sigterm(
    redis_url: str, tiny_model_dir: Path
) -> None:
    url = redis_url.rsplit("/", 1)[0] + "/2"
    r = redis.Redis.from_url(url)
    r.flushdb()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RADIXSERVE_")}
    env.update(
        REDIS_URL=url,
        RADIXSERVE_MODEL=str(tiny_model_dir),
        RADIXSERVE_PORT="0",
        RADIXSERVE_MAX_TOTAL_TOKENS="1024",
    )
    procs = {
        name: subprocess.Popen(
            [sys.executable, "-m", "radixserve", *cmd],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for name, cmd in compose_commands().items()
    }
    try:
        deadline = time.monotonic() + 120
        live: set[str] = set()
        while time.monotonic() < deadline and live != set(procs):
            for name, p in procs.items():
                assert p.poll() is None, f"{name} exited: {p.stderr.read().decode()[-2000:]}"  # type: ignore[union-attr]
            live = {k.decode().split(":")[2] for k in r.keys(f"{constants.LIVE_PREFIX}:*")}
            time.sleep(0.2)
        assert live == set(procs)
    finally:
        for p in procs.values():
            p.send_signal(signal.SIGTERM)
        codes = {name: p.wait(timeout=60) for name, p in procs.items()}
    assert codes == dict.fromkeys(procs, 0)
    # Stopped instances remove their liveness keys.
    assert r.keys(f"{constants.LIVE_PREFIX}:*") == []


@pytest.mark.parametrize(
    ("setup", "words"),
    [
        ("missing", "does not exist"),
        ("gpt2", "GPT2LMHeadModel"),
        ("corrupt-gguf", "corrupt.gguf"),
    ],
)
def test_serve_rejects_models_it_cannot_serve(tmp_path: Path, setup: str, words: str) -> None:
    if setup == "missing":
        model = tmp_path / "missing"
    elif setup == "gpt2":
        model = tmp_path / "gpt2"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    else:
        model = tmp_path / "corrupt.gguf"
        model.write_bytes(b"GGUF" + b"\x00" * 20)
    res = subprocess.run(
        [sys.executable, "-m", "radixserve", "serve", "--model", str(model)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode != 0
    assert words in res.stderr, res.stderr
