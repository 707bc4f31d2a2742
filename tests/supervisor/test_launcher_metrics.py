"""`radixserve serve --metrics-port P`: every child its own metrics port from P up (a port in
use skipped), and the observability flags reach every child, off switches included."""

from __future__ import annotations

import socket

import pytest

from radixserve import launcher
from services.executor.main import parse_args as executor_args
from services.gateway.main import buckets_of, build_parser
from services.tokenizer.main import parse_args as tokenizer_args
from tests.conftest import free_port_block


def ports(specs: list[launcher.ChildSpec]) -> dict[str, int]:
    return {s.name: int(s.argv[s.argv.index("--metrics-port") + 1]) for s in specs}


def test_each_child_gets_its_own_port_skipping_one_in_use() -> None:
    # A block below the ephemeral range: free_port()'s neighbour can be another worker's
    # connection (base + 1 was once "already in use" before the test bound it).
    base = free_port_block(8)
    with socket.socket() as busy:
        busy.bind(("", base + 1))  # the second child's port is taken
        busy.listen()
        specs = launcher.child_specs(
            launcher.parse_args(["--metrics-port", str(base), "--detokenizer-partitions", "2"])
        )
    got = ports(specs)
    assert len(set(got.values())) == len(specs) == 7
    assert base + 1 not in got.values()
    assert got["scheduler-0"] == base
    assert launcher.metrics_ports(specs)[0] == f"scheduler-0 :{base}"


def test_no_port_no_flag() -> None:
    specs = launcher.child_specs(launcher.parse_args([]))
    assert not any("--metrics-port" in s.argv for s in specs)
    assert launcher.metrics_ports(specs) == []


def test_off_switches_and_lists_reach_the_children(monkeypatch: pytest.MonkeyPatch) -> None:
    a = launcher.parse_args(
        [
            "--no-enable-metrics",
            "--otlp-traces-endpoint",
            "http://collector:4318",
            "--bucket-time-to-first-token",
            "0.5",
            "1",
            "2.5",
        ]
    )
    env = launcher.child_specs(a)[0].env
    for key, value in env.items():
        if key.startswith("RADIXSERVE_"):
            monkeypatch.setenv(key, value)
    child = tokenizer_args([])
    assert child.enable_metrics is False
    assert child.otlp_traces_endpoint == "http://collector:4318"
    assert executor_args([]).enable_metrics is False
    gateway = build_parser().parse_args([])
    assert buckets_of(gateway).time_to_first_token == (0.5, 1.0, 2.5)


def test_bucket_flags_take_sglangs_form_and_refuse_disorder(
    capsys: pytest.CaptureFixture[str],
) -> None:
    gateway = build_parser().parse_args(["--bucket-e2e-request-latency", "1", "10", "100"])
    assert buckets_of(gateway).e2e_request_latency == (1.0, 10.0, 100.0)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--bucket-inter-token-latency", "0.1", "0.05"])
    assert "--bucket-inter-token-latency" in capsys.readouterr().err
