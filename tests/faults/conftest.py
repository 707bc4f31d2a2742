"""One stack for the fault suite: `radixserve serve` with a tiny random model on the CPU, on a
redis-server of its own (a fixed port, so Redis can be stopped and started again)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from loadtest.fault_stack import RedisServer, Stack
from loadtest.faults import Settings
from tests.executor.helpers import write_tiny_model

# Short: a few requests each side of the fault, small answers. hang_s bounds every request
# (a restarted service needs up to half a minute on a busy 2-core box, and requests queued
# for it wait).
# Answers of 64 tokens keep a few requests mid-generation at any moment, so every fault finds
# work in flight (the tests check that it did).
SETTINGS = Settings(
    interval=0.25, hang_s=90.0, before_ok=3, after_ok=3, recover_timeout=120.0, max_tokens=64
)
# Constrained requests: these pass through the grammar service.
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
GRAMMAR_SETTINGS = Settings(
    interval=0.25,
    hang_s=90.0,
    before_ok=3,
    after_ok=3,
    recover_timeout=120.0,
    max_tokens=16,
    extra={
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}}
    },
)


@pytest.fixture(scope="session")
def fault_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("faults"), "llama", 5)


@pytest.fixture(scope="session")
def fault_stack_session(
    fault_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Stack]:
    redis = RedisServer()
    redis.start()
    args = ["--model", str(fault_model_dir), "--device", "cpu", "--max-total-tokens", "4096"]
    stack = Stack(redis, args, tmp_path_factory.mktemp("fault-logs"))
    try:
        stack.start(timeout=300)
        yield stack
    finally:
        stack.stop()
        redis.close()


@pytest.fixture
def fault_stack(fault_stack_session: Stack) -> Stack:
    """The shared stack, serving: a scenario that left it broken (its test failed) does not
    fail the next one too; it is started again."""
    stack = fault_stack_session
    if stack.redis.proc is None:
        stack.redis.start()
    try:
        stack.wait_healthy(60)
    except (TimeoutError, RuntimeError):
        stack.stop()
        stack.start(timeout=300)
    return stack
