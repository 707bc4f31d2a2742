"""Container healthcheck: exit 0 when this host's instance has a live heartbeat in Redis.

Instances are named `{hostname}-{pid}` by default, so the check looks for any live key of any
service whose instance starts with this container's hostname.
"""

from __future__ import annotations

import os
import socket
import sys

import redis

from shared import constants


def main() -> int:
    r = redis.Redis.from_url(os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    host = socket.gethostname()
    for key in r.scan_iter(match=f"{constants.LIVE_PREFIX}:*", count=500):
        instance = key.decode().split(":", 3)[-1]
        if instance.startswith(host) or f"-{host}-" in instance:
            return 0
    print(f"no live heartbeat for host {host}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
