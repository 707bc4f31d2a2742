"""`radixserve serve`: every service on this machine, as its own process.

Starts a private redis-server when no REDIS_URL is given, then each service with the same
`radixserve <service>` command compose.yaml runs, passing the configuration through the
services' RADIXSERVE_* environment twins. Waits until the gateway reports every service live,
prints the URL, and on Ctrl-C / SIGTERM stops the services (gateway first), then Redis.
"""

from __future__ import annotations

import argparse
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from shared.config import EnvArgumentParser, add_common_flags, env_name, positive
from shared.model_files import ModelNotFoundError, resolve_model

SERVICE_ORDER = ["scheduler", "detokenizer", "tokenizer", "grammar", "executor", "gateway"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from services.executor.main import add_flags as executor_flags
    from services.gateway.main import add_flags as gateway_flags
    from services.grammar.main import add_flags as grammar_flags
    from services.scheduler.main import add_flags as scheduler_flags
    from services.tokenizer.main import add_flags as tokenizer_flags

    p = EnvArgumentParser(prog="radixserve serve", description=__doc__)
    add_common_flags(p)
    for add in (gateway_flags, tokenizer_flags, grammar_flags, scheduler_flags, executor_flags):
        add(p)
    p.add_flag(
        "--tokenizer-replicas", type=int, default=1, check=positive, help="tokenizer processes"
    )
    p.add_flag(
        "--startup-timeout",
        type=float,
        default=600.0,
        check=positive,
        help="seconds to wait for every service to be ready",
    )
    a = p.parse_args(argv)
    if "REDIS_URL" not in os.environ and a.redis_url == "redis://127.0.0.1:6379/0":
        a.redis_url = ""  # nothing given: run a private Redis
    return a


def check_model(a: argparse.Namespace) -> str:
    """Fail before starting anything when the model cannot be served; returns its name."""
    from services.executor.errors import ModelLoadError, UnsupportedModelError
    from services.executor.model_config import ModelConfig
    from services.executor.weights.gguf import open_gguf

    try:
        source = resolve_model(a.model, a.served_model_name)
        if source.kind == "gguf":
            ModelConfig.from_gguf(open_gguf(source.path))
        else:
            ModelConfig.from_hf_dir(source.path)
    except (ModelNotFoundError, ModelLoadError, UnsupportedModelError) as e:
        raise SystemExit(f"radixserve serve: cannot serve this model: {e}") from None
    return source.name


def start_redis() -> tuple[subprocess.Popen[bytes], str, str]:
    binary = shutil.which("redis-server")
    if binary is None:
        raise SystemExit(
            "radixserve serve: redis-server not found; install it (apt-get install redis-server) "
            "or point REDIS_URL at a running Redis"
        )
    workdir = tempfile.mkdtemp(prefix="radixserve-redis-")
    sock = os.path.join(workdir, "redis.sock")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            "0",
            "--unixsocket",
            sock,
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        preexec_fn=_die_with_parent,
    )
    for _ in range(100):
        if os.path.exists(sock):
            return proc, f"unix://{sock}", workdir
        if proc.poll() is not None:
            break
        time.sleep(0.05)
    proc.kill()
    raise SystemExit("radixserve serve: the private redis-server did not start")


def child_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in vars(a).items():
        if value is None or (isinstance(value, bool) and not value):
            continue
        env[env_name("--" + key.replace("_", "-"))] = str(value)
    env["REDIS_URL"] = a.redis_url
    env.pop("RADIXSERVE_REDIS_URL", None)
    env.pop("RADIXSERVE_INSTANCE_ID", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _die_with_parent() -> None:
    """In each child, before exec: get SIGTERM when the launcher dies, however it dies
    (Linux), so no service outlives `radixserve serve`."""
    if sys.platform.startswith("linux"):
        import ctypes

        pr_set_pdeathsig = 1
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGTERM)


def spawn(a: argparse.Namespace) -> dict[str, subprocess.Popen[bytes]]:
    env = child_env(a)
    cmd = [sys.executable, "-m", "radixserve"]
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def popen(args: list[str]) -> subprocess.Popen[bytes]:
        return subprocess.Popen(args, env=env, preexec_fn=_die_with_parent)

    for service in SERVICE_ORDER:
        if service == "tokenizer":
            for i in range(a.tokenizer_replicas):
                procs[f"tokenizer-{i}"] = popen([*cmd, "tokenizer"])
        elif service == "detokenizer":
            for i in range(a.detokenizer_partitions):
                procs[f"detokenizer-{i}"] = popen([*cmd, "detokenizer", "--partition", str(i)])
        else:
            procs[service] = popen([*cmd, service])
    return procs


def wait_ready(url: str, procs: dict[str, subprocess.Popen[bytes]], timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for name, p in procs.items():
            if p.poll() is not None:
                raise SystemExit(f"radixserve serve: {name} exited with code {p.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as resp:
                if resp.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            pass
        time.sleep(0.25)
    raise SystemExit(f"radixserve serve: services not ready after {timeout:.0f}s")


def stop_all(procs: dict[str, subprocess.Popen[bytes]], timeout: float = 40.0) -> None:
    """Gateway first (no new requests), then the rest; SIGKILL whatever outlives `timeout`."""
    order = ["gateway"] + [n for n in procs if n != "gateway"]
    for name in order:
        p = procs.get(name)
        if p is not None and p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout
    for p in procs.values():
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    name = check_model(a)
    redis_proc = workdir = None
    if not a.redis_url:
        redis_proc, a.redis_url, workdir = start_redis()
    started = time.monotonic()
    procs: dict[str, subprocess.Popen[bytes]] = {}

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops everything the way Ctrl-C does

    signal.signal(signal.SIGTERM, on_signal)
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    url = f"http://{host}:{a.port}"
    try:
        procs = spawn(a)
        wait_ready(url, procs, a.startup_timeout)
        print(
            f"radixserve is serving {name} at {url} (ready in {time.monotonic() - started:.1f}s; "
            "Ctrl-C stops it)",
            flush=True,
        )
        while True:
            for pname, p in procs.items():
                if p.poll() is not None:
                    raise SystemExit(f"radixserve serve: {pname} exited with code {p.returncode}")
            time.sleep(0.5)
    except KeyboardInterrupt:
        print("radixserve: stopping", flush=True)
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_all(procs)
        if redis_proc is not None:
            redis_proc.terminate()
            redis_proc.wait(timeout=10)
            shutil.rmtree(workdir or "", ignore_errors=True)
