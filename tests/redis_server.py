"""A redis-server the tests can stop and start again on the same port (a Redis restart: the
new server is empty and has a new run_id)."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time

import redis


class RedisServer:
    def __init__(self, port: int) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: apt-get install redis-server")
        self.binary, self.port = binary, port
        self.workdir = tempfile.mkdtemp(prefix="rs-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> None:
        args = ["--port", str(self.port), "--bind", "127.0.0.1", "--save", ""]
        args += ["--appendonly", "no", "--dir", self.workdir]
        self.proc = subprocess.Popen(
            [self.binary, *args], stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        client = redis.Redis(port=self.port)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return
                except redis.ConnectionError:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        self.stop()
                        raise RuntimeError("redis-server did not start") from None
                    time.sleep(0.05)
        finally:
            client.close()

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()  # as a crash or an operator's restart would: nothing saved
            self.proc.wait(timeout=10)
            self.proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
