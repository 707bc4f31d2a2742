"""The private redis-server of `radixserve serve`: a unix socket in a directory only this user
can open, a random password per launch, and a restart on the same socket and password when it
dies (the services reconnect to the same URL)."""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import tempfile
import time
from urllib.parse import quote

from radixserve.children import die_with_parent


class RedisServer:
    def __init__(self) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            raise SystemExit(
                "radixserve serve: redis-server not found; install it (apt-get install "
                "redis-server) or point REDIS_URL at a running Redis"
            )
        self.binary = binary
        self.workdir = tempfile.mkdtemp(prefix="radixserve-redis-")  # mode 0700
        os.chmod(self.workdir, 0o700)
        self.socket = os.path.join(self.workdir, "redis.sock")
        self.password = secrets.token_hex(16)
        # The password goes in a file only this user can read, not on the command line (ps).
        self.config = os.path.join(self.workdir, "redis.conf")
        fd = os.open(self.config, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(
                f'port 0\nunixsocket {self.socket}\nunixsocketperm 700\nsave ""\n'
                f"appendonly no\ndir {self.workdir}\nrequirepass {self.password}\n"
            )
        self.proc: subprocess.Popen[bytes] | None = None
        self.started_at = 0.0

    @property
    def url(self) -> str:
        return f"unix://{self.socket}?password={quote(self.password)}"

    def start(self) -> None:
        """Start it and wait for its socket; SystemExit when it does not come up."""
        if os.path.exists(self.socket):
            os.unlink(self.socket)  # a dead server's leftover: wait for the new one's
        self.proc = subprocess.Popen(
            [self.binary, self.config],
            stdout=subprocess.DEVNULL,
            preexec_fn=die_with_parent,
            # Its own session: a Ctrl-C reaches the whole terminal's process group, and Redis
            # must outlive the services' drain (the launcher stops it last).
            start_new_session=True,
        )
        self.started_at = time.monotonic()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if os.path.exists(self.socket):
                return
            if self.proc.poll() is not None:
                break
            time.sleep(0.05)
        self.proc.kill()
        self.proc.wait()
        raise SystemExit("radixserve serve: the private redis-server did not start")

    def exit_code(self) -> int | None:
        """Its exit code once it has died, None while it runs."""
        return None if self.proc is None else self.proc.poll()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.workdir, ignore_errors=True)
