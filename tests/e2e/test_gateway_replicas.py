"""`radixserve serve --gateway-replicas 2` on the CPU: both gateways listen on the one API port
(and the one gRPC port), the kernel hands new connections to each of them, every request
succeeds, and a replica killed with SIGKILL leaves the port served by the other while the
supervisor restarts it."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import free_port_block
from tests.e2e.stack import Stack, start_stack

pytestmark = [pytest.mark.slow]

BODY = json.dumps({"prompt": "The capital of France is", "max_tokens": 2}).encode()
MAX_TRIES = 200  # connections before giving up on a replica being handed one (odds 2**-200)


@pytest.fixture(scope="module")
def stack(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    args = ["--model", str(tiny_model_dir), "--max-total-tokens", "8192"]
    args += ["--gateway-replicas", "2", "--metrics-port", str(free_port_block())]
    log = tmp_path_factory.mktemp("gw-replicas") / "serve.log"
    stack = start_stack(args, log, None, grpc=True)  # its own private Redis
    yield stack
    assert stack.stop() == 0, stack.log_tail()
    assert "Traceback" not in stack.log_path.read_text(errors="replace"), stack.log_tail(200)


def metrics_ports(stack: Stack) -> dict[str, int]:
    """child name -> its metrics port, from the line serve prints before starting them."""
    line = next(
        line
        for line in stack.log_path.read_text().splitlines()
        if line.startswith("metrics (/metrics, /health) on ")
    )
    return {name: int(port) for name, port in re.findall(r"(\w+-\d+) :(\d+)", line)}


def complete(stack: Stack) -> int:
    """One completion over a connection of its own (urllib opens one per call): its status."""
    req = urllib.request.Request(
        f"{stack.base_url}/v1/completions", BODY, {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(req, timeout=60) as resp:
            body = json.loads(resp.read())
            assert body["choices"][0]["finish_reason"] in ("length", "stop"), body
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return e.code


def answered(port: int) -> float:
    """Completions the gateway with this metrics port answered (0 while it does not serve)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return 0.0
    return sum(
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "radixserve:responses_total" and s.labels["endpoint"] == "/v1/completions"
    )


def until_answered(stack: Stack, ports: list[int]) -> list[int]:
    """Completions over new connections until each gateway of `ports` answered one; their
    statuses."""
    statuses: list[int] = []
    while not all(answered(p) > 0 for p in ports):
        assert len(statuses) < MAX_TRIES, f"a replica got no connection\n{stack.log_tail()}"
        statuses.append(complete(stack))
    return statuses


def wait_log(stack: Stack, text: str) -> None:
    """Until serve's log says `text`."""
    deadline = time.monotonic() + 60
    while text not in stack.log_path.read_text(errors="replace"):
        assert stack.proc.poll() is None and time.monotonic() < deadline, stack.log_tail()
        time.sleep(0.05)


def gateway_pid(stack: Stack, metrics_port: int) -> int:
    out = subprocess.run(
        [
            "pgrep",
            "-P",
            str(stack.proc.pid),
            "-f",
            f"gateway --reuse-port --metrics-port {metrics_port}$",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    (pid,) = out.stdout.split()
    return int(pid)


def test_both_replicas_answer_on_one_port(stack: Stack) -> None:
    ports = metrics_ports(stack)
    gateways = [ports["gateway-0"], ports["gateway-1"]]
    assert len(set(ports.values())) == len(ports) == 7
    statuses = until_answered(stack, gateways)
    assert statuses and set(statuses) == {200}
    assert sum(answered(p) for p in gateways) == len(statuses)
    assert stack.grpc_target is not None  # both replicas share the gRPC port too
    with grpc.insecure_channel(stack.grpc_target) as channel:
        # Each replica's health follows readiness on its own poll: watch it turn SERVING.
        watch = health_pb2_grpc.HealthStub(channel).Watch(
            health_pb2.HealthCheckRequest(), timeout=30
        )
        serving = health_pb2.HealthCheckResponse.SERVING
        assert any(update.status == serving for update in watch)


def test_a_killed_replica_leaves_the_port_served_and_is_restarted(stack: Stack) -> None:
    ports = metrics_ports(stack)
    killed, other = ports["gateway-0"], ports["gateway-1"]
    before = answered(other)
    os.kill(gateway_pid(stack, killed), signal.SIGKILL)
    # Once the supervisor has reaped it, its listening socket is gone from the port.
    wait_log(stack, "gateway-0 (gateway-0.0) exited with code -9")
    statuses = [complete(stack) for _ in range(16)]
    assert statuses == [200] * 16
    # The other replica answered them, or the restarted one any that came after its start.
    assert answered(other) - before + answered(killed) == 16
    wait_log(stack, "restarted gateway-0 as gateway-0.1")
    assert set(until_answered(stack, [killed])) <= {200}
