"""Fixtures shared by every test: a real redis-server per session, a clean database per test."""

from __future__ import annotations

import os
import random
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis
import torch

from tests.redis_server import RedisServer

# Triton kernels run under the interpreter where there is no GPU. This must be set before
# anything imports triton (transformers does, through torch._dynamo).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The tokenizers the services convert (shared/tokenizer_cache.py) go to a directory of this run,
# not the user's ~/.cache: every run writes tiny models of its own. XDG_CACHE_HOME, since the
# stacks pass no RADIXSERVE_* variable on; made once by pytest's first process, and inherited
# by xdist's workers and every service they start.
TEST_CACHE_ENV = "RADIXSERVE_TEST_CACHE_HOME"
if TEST_CACHE_ENV not in os.environ:
    os.environ[TEST_CACHE_ENV] = os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(
        prefix="rs-test-cache-"
    )


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):  # the first process, which made the directory
        shutil.rmtree(os.environ[TEST_CACHE_ENV], ignore_errors=True)


# Session-scoped stacks several files share: tests/e2e's tiny stack, tests/faults' stack
SHARED_STACKS = ("tiny_stack", "fault_stack_session")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (scripts/check.sh: `-n 3 --dist loadgroup`) a group runs on one
    worker: each file is a group (its module fixtures, such as a stack, start once), and the
    files that use one of the session-wide stacks (SHARED_STACKS) join one group each, so that
    stack starts once rather than on each worker (about 25 s of CPU for the tiny stack, 19
    for the fault suite's). First among the hooks: xdist's worker reads the marks in its own,
    and without them ran a file's tests on both workers, each starting the file's stack."""
    shared: dict[str, str] = {}  # file -> the shared stack it uses
    for item in items:
        for stack in SHARED_STACKS:
            if stack in getattr(item, "fixturenames", ()):
                shared[item.nodeid.split("::")[0]] = stack
    for item in items:
        path = item.nodeid.split("::")[0]
        item.add_marker(pytest.mark.xdist_group(shared.get(path, path)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# Linux's ephemeral range starts at 32768 (ip_local_port_range): blocks below it are never
# taken by a client connection's port, as free_port()'s can be between the check and the bind.
BLOCK_PORTS = range(20000, 32768)


def free_port_block(n: int = 16) -> int:
    """The first of n consecutive ports free on every address now, for `--metrics-port`
    (serve gives each child base + i). Drawn at random below the ephemeral range: a block
    from free_port() once met a detokenizer's port taken by a connection of the other
    worker's stack."""
    rng = random.Random()
    for _ in range(100):
        base = rng.randrange(BLOCK_PORTS.start, BLOCK_PORTS.stop - n)
        socks: list[socket.socket] = []
        try:
            for port in range(base, base + n):
                socks.append(socket.socket())
                socks[-1].bind(("0.0.0.0", port))
            return base
        except OSError:
            continue
        finally:
            for sock in socks:
                sock.close()
    raise RuntimeError(f"no {n} consecutive free ports in {BLOCK_PORTS}")


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """A private redis-server on a free port for the whole test session."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise RuntimeError("redis-server is not installed: apt-get install redis-server")
    port = free_port()
    workdir = tempfile.mkdtemp(prefix="rs-redis-")
    proc = subprocess.Popen(
        [
            binary,
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--save",
            "",
            "--appendonly",
            "no",
            "--dir",
            workdir,
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.STDOUT,
    )
    client = redis.Redis(port=port)
    for _ in range(100):
        try:
            client.ping()
            break
        except redis.ConnectionError:
            time.sleep(0.05)
    else:
        proc.kill()
        raise RuntimeError("redis-server did not start")
    url = f"redis://127.0.0.1:{port}/0"
    os.environ["REDIS_URL"] = url
    yield url
    proc.terminate()
    proc.wait(timeout=10)
    shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def restartable_redis() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which the test may stop and start again."""
    server = RedisServer(free_port())
    server.start()
    yield server
    server.close()


@pytest.fixture
def redis_sync(redis_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(redis_url)
    client.flushdb()  # database 0 only: end-to-end stacks live in other databases
    yield client
    client.close()


@pytest.fixture
async def aredis(redis_url: str, redis_sync: redis.Redis) -> AsyncIterator[aioredis.Redis]:
    """An asyncio client on a freshly flushed database."""
    client = aioredis.from_url(redis_url)
    yield client
    await client.aclose()
