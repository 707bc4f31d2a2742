"""`radixserve serve --gateway-replicas N`: N gateway children sharing the API port through
--reuse-port, each with its own instance id (so its own reply stream) and metrics port, and a
clear refusal where they could not share one port."""

from __future__ import annotations

import socket

import pytest

from radixserve import launcher
from shared import constants
from tests.conftest import free_port


def gateways(argv: list[str]) -> list[launcher.ChildSpec]:
    return [s for s in launcher.child_specs(launcher.parse_args(argv)) if s.service == "gateway"]


def test_replicas_are_gateways_that_share_the_port() -> None:
    base = free_port()
    specs = launcher.child_specs(
        launcher.parse_args(["--gateway-replicas", "3", "--metrics-port", str(base)])
    )
    replicas = specs[-3:]  # started last, as one gateway is: everything else is up first
    assert [s.name for s in replicas] == ["gateway-0", "gateway-1", "gateway-2"]
    assert all(s.service == "gateway" for s in replicas)
    assert all(s.argv[3:5] == ["gateway", "--reuse-port"] for s in replicas)
    assert len({s.argv[s.argv.index("--metrics-port") + 1] for s in specs}) == len(specs)
    # Every incarnation of every replica has its own instance id, so its own reply stream.
    streams = {constants.reply_stream(s.instance(n)) for s in replicas for n in range(3)}
    assert len(streams) == 9


def test_one_gateway_keeps_its_command() -> None:
    (only,) = gateways([])
    assert only.argv[-1] == "gateway" and "--reuse-port" not in only.argv
    assert only.env["RADIXSERVE_REUSE_PORT"] == "false"


def test_launches_sharing_a_redis_keep_their_instances_apart() -> None:
    a = launcher.parse_args(["--gateway-replicas", "2"])
    ours, theirs = launcher.child_specs(a, "-host-1"), launcher.child_specs(a, "-host-2")
    ids = {s.instance(0) for s in ours + theirs if s.service == "gateway"}
    assert ids == {"gateway-0.0-host-1", "gateway-1.0-host-1", "gateway-0.0-host-2"} | {
        "gateway-1.0-host-2"
    }


@pytest.mark.parametrize("flag", ["--port", "--grpc-port"])
def test_replicas_need_a_named_port(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        launcher.parse_args(["--gateway-replicas", "2", flag, "0"])
    assert f"{flag} 0 would give each of the --gateway-replicas its own" in capsys.readouterr().err
    assert launcher.parse_args([flag, "0"]).gateway_replicas == 1  # one gateway: any free port


def test_a_port_someone_listens_on_is_found_even_if_they_share_it() -> None:
    with socket.socket() as shared:
        # Another launch's replica: with SO_REUSEPORT ours would silently share its port.
        shared.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        shared.bind(("127.0.0.1", 0))
        shared.listen()
        port = shared.getsockname()[1]
        problem = launcher.port_in_use("127.0.0.1", port)
    assert problem is not None and f"cannot listen on 127.0.0.1:{port}" in problem
    assert launcher.port_in_use("127.0.0.1", free_port()) is None
    assert launcher.port_in_use("no-such-host.invalid", 8000) is None  # the gateway says why
