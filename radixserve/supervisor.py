"""The supervision loop of `radixserve serve`.

- A child that dies after the stack was ready is restarted with backoff (radixserve.restart);
  past the restart limit everything stops and the launcher exits 1.
- A child that dies before the stack was ever ready stops everything at once: that is a
  configuration error (a bad flag, a model that does not load), and restarting would loop.
- A dead child's liveness key is deleted at once, so routing and /health stop counting it
  without waiting for its TTL (a dead scheduler's leadership is released the same way).
- The private redis-server, when there is one, is restarted on the same socket and password.
- Given a zygote, the `radixserve <service>` children are forked by it
  (radixserve/zygote.py) and adopted here, this process being their subreaper; the orphans
  that adoption also brings (a dead service's own children) are reaped each tick.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable

import redis

from radixserve.children import Child, ChildSpec, stop_children
from radixserve.redis_proc import RedisServer
from radixserve.restart import GiveUp, RestartPolicy, RestartTracker
from radixserve.spawner import Zygote, become_subreaper, reap_orphans
from shared import constants

TICK_S = 0.1  # how often exits are noticed
RELEASE_IF_OWNER = (
    "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end return 0"
)


def say(message: str) -> None:
    print(f"radixserve serve: {message}", file=sys.stderr, flush=True)


class Supervisor:
    def __init__(
        self,
        specs: list[ChildSpec],
        redis_url: str,
        is_ready: Callable[[], bool],
        on_ready: Callable[[], None] = lambda: None,
        on_tick: Callable[[], None] = lambda: None,
        policy: RestartPolicy | None = None,
        redis_server: RedisServer | None = None,
        startup_timeout_s: float = 600.0,
        zygote: Zygote | None = None,
    ) -> None:
        self.policy = policy or RestartPolicy()
        self.children = [Child(s) for s in specs]
        self.trackers = {c.spec.name: RestartTracker(self.policy) for c in self.children}
        self.redis_url, self.redis_server = redis_url, redis_server
        self.redis_tracker = RestartTracker(self.policy)
        self.redis_restart_at: float | None = None
        self.is_ready, self.on_ready, self.on_tick = is_ready, on_ready, on_tick
        self.startup_timeout_s = startup_timeout_s
        self.ready = False
        self._stop = threading.Event()
        self._client: redis.Redis | None = None
        self.zygote = zygote

    def run(self) -> int:
        """Start every child and supervise until Ctrl-C / SIGTERM (0) or a failure (1)."""
        try:
            if self.zygote is not None and not (self.children and become_subreaper()):
                self.zygote.close()  # it could not hand its services to this process
                self.zygote = None
            for c in self.children:
                c.start(self.zygote)
            started = time.monotonic()
            while not self._stop.is_set():
                now = time.monotonic()
                failure = self._watch_redis(now) or self._watch_children(now)
                if failure is not None:
                    say(f"{failure}; stopping everything")
                    return 1
                if not self.ready:
                    if self.is_ready():
                        self.ready = True
                        self.on_ready()
                    elif now - started > self.startup_timeout_s:
                        say(f"not ready after {self.startup_timeout_s:.0f}s; stopping everything")
                        return 1
                self._reap()
                self.on_tick()
                self._stop.wait(TICK_S)
        except KeyboardInterrupt:
            say("stopping")
        finally:
            self._stop_all()
        say("stopped")
        return 0

    def request_stop(self) -> None:
        """Make `run` stop everything and return 0, from any thread."""
        self._stop.set()

    def _stop_all(self) -> None:
        first = [c for c in self.children if c.spec.service == "gateway"]
        stop_children(first + [c for c in self.children if c not in first])
        if self.zygote is not None:
            self.zygote.close()
        if self._client is not None:
            self._client.close()
        if self.redis_server is not None:
            self.redis_server.stop()

    def _watch_children(self, now: float) -> str | None:
        for c in self.children:
            if c.restart_at is not None:
                if now >= c.restart_at:
                    c.start(self.zygote)
                    say(f"restarted {c.spec.name} as {c.instance}")
                continue
            code = c.exit_code()
            if code is None:
                continue
            self._forget(c.spec.service, c.instance)
            what = f"{c.spec.name} ({c.instance}) exited with code {code}"
            if not self.ready:
                return f"{what} before the stack was ready"
            decision = self.trackers[c.spec.name].on_exit(now, c.started_at)
            if isinstance(decision, GiveUp):
                return f"{what}; not restarting it again: {decision.reason} (--max-restarts)"
            c.restart_at = now + decision.delay_s
            say(f"{what}; restarting it in {decision.delay_s:g}s")
        return None

    def _reap(self) -> None:
        """Adopted orphans (only a subreaper has any), leaving the pids others wait for."""
        if self.zygote is None:
            return
        self.zygote.running()  # a dead zygote is reaped here, and started again when needed
        known = [c.proc.pid for c in self.children if c.proc is not None]
        if self.zygote.proc is not None:
            known.append(self.zygote.proc.pid)
        if self.redis_server is not None and self.redis_server.proc is not None:
            known.append(self.redis_server.proc.pid)
        reap_orphans(known)

    def _watch_redis(self, now: float) -> str | None:
        server = self.redis_server
        if server is None:
            return None
        if self.redis_restart_at is not None:
            if now >= self.redis_restart_at:
                server.start()
                self.redis_restart_at = None
                say("restarted redis-server on the same socket; the services reconnect")
            return None
        code = server.exit_code()
        if code is None:
            return None
        what = f"redis-server exited with code {code}"
        if not self.ready:
            return f"{what} before the stack was ready"
        decision = self.redis_tracker.on_exit(now, server.started_at)
        if isinstance(decision, GiveUp):
            return f"{what}; not restarting it again: {decision.reason} (--max-restarts)"
        self.redis_restart_at = now + decision.delay_s
        say(f"{what}; restarting it in {decision.delay_s:g}s")
        return None

    def _forget(self, service: str, instance: str) -> None:
        """Delete a dead instance's liveness key (and its scheduler leadership) now."""
        if self._client is None:
            self._client = redis.Redis.from_url(
                self.redis_url, socket_timeout=2, socket_connect_timeout=2
            )
        try:
            self._client.delete(constants.live_key(service, instance))
            if service == "scheduler":  # compare-and-delete: never a new leader's key
                self._client.eval(RELEASE_IF_OWNER, 1, constants.SCHEDULER_LEADER_KEY, instance)
        except redis.RedisError as e:  # Redis down too: the key expires by its TTL
            say(f"could not delete the liveness key of {instance}: {e}")
