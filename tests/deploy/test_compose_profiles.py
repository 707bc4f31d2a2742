"""compose.yaml as docker-compose itself reads it (Debian's 1.29, which scripts/install.sh
installs; `config` needs no Docker daemon): it validates with and without the monitoring and
tracing profiles, Prometheus and Grafana start only with the monitoring profile, every
service serves metrics inside the compose network only, and the tools are published on
127.0.0.1 only."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
SERVICES = {"gateway", "tokenizer", "grammar", "scheduler", "executor", "detokenizer"}
MONITORING = {"prometheus", "grafana"}
TRACING = {"jaeger"}


def docker_compose() -> str:
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.fail(
            "docker-compose is not installed: run scripts/install.sh (it installs Debian's "
            "docker-compose, which these tests use to validate compose.yaml)"
        )
    return binary


def run_compose(
    tmp_path: Path, env: dict[str, str], *args: str
) -> subprocess.CompletedProcess[str]:
    """docker-compose over the repository's compose.yaml with only `env` for .env: neither the
    developer's own .env nor their shell's variables reach it."""
    env_file = tmp_path / "test.env"
    env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
    command = [docker_compose(), "--env-file", str(env_file), "-f", str(ROOT / "compose.yaml")]
    command += ["--project-directory", str(ROOT), *args]
    clean = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)}
    return subprocess.run(
        command, capture_output=True, text=True, env=clean, timeout=60, check=False
    )


def config(tmp_path: Path, env: dict[str, str], *profiles: str) -> dict[str, Any]:
    flags = [arg for p in profiles for arg in ("--profile", p)]
    done = run_compose(tmp_path, env, *flags, "config")
    assert done.returncode == 0, done.stderr
    resolved: dict[str, Any] = yaml.safe_load(done.stdout)
    return resolved


def started(resolved: dict[str, Any], profiles: set[str]) -> set[str]:
    """The services `up` starts: those without profiles and those sharing an active one. (1.29's
    `config` prints every service with its profiles; `up` selects by this rule.)"""
    return {
        name
        for name, spec in resolved["services"].items()
        if not spec.get("profiles") or profiles & set(spec["profiles"])
    }


ENV = {"REDIS_PASSWORD": "0123abcd"}


def test_docker_compose_1_29_supports_profiles() -> None:
    assert "docker-compose" in (ROOT / "scripts" / "install.sh").read_text()
    done = subprocess.run(
        [docker_compose(), "version", "--short"], capture_output=True, text=True, check=True
    )
    major, minor = (int(x) for x in done.stdout.strip().split(".")[:2])
    assert (major, minor) >= (1, 28), f"profiles need docker-compose 1.28+, got {done.stdout}"


@pytest.mark.parametrize("profiles", [(), ("monitoring",), ("tracing",), ("monitoring", "tracing")])
def test_compose_validates_and_profiles_pick_the_tools(
    tmp_path: Path, profiles: tuple[str, ...]
) -> None:
    resolved = config(tmp_path, ENV, *profiles)
    up = started(resolved, set(profiles))
    assert up >= SERVICES | {"redis"}
    assert (up & MONITORING) == (MONITORING if "monitoring" in profiles else set())
    assert (up & TRACING) == (TRACING if "tracing" in profiles else set())
    assert up <= SERVICES | {"redis"} | MONITORING | TRACING, "a service outside any profile"


def test_the_profiles_are_the_documented_ones(tmp_path: Path) -> None:
    done = run_compose(tmp_path, ENV, "config", "--profiles")
    assert done.returncode == 0, done.stderr
    assert set(done.stdout.split()) == {"monitoring", "tracing"}


def test_compose_still_refuses_to_start_without_a_password(tmp_path: Path) -> None:
    done = run_compose(tmp_path, {}, "--profile", "monitoring", "config")
    assert done.returncode != 0
    assert "run scripts/make_env.sh" in done.stderr


def published(spec: dict[str, Any]) -> list[tuple[str, str]]:
    """(host address, container port) of each published port, from 1.29's resolved form."""
    out = []
    for port in spec.get("ports", []):
        if isinstance(port, dict):
            port = f"{port['host_ip']}:{port['published']}:{port['target']}"
        host_ip, _host_port, target = port.rsplit(":", 2)
        out.append((host_ip, target.split("/")[0]))
    return out


def test_metrics_stay_inside_and_the_tools_listen_on_localhost(tmp_path: Path) -> None:
    resolved = config(tmp_path, ENV, "monitoring", "tracing")["services"]
    for name in SERVICES:
        env = resolved[name]["environment"]
        assert env["RADIXSERVE_METRICS_PORT"] == "9090", name
        assert "9090" not in {target for _, target in published(resolved[name])}, name
        assert env["RADIXSERVE_OTLP_TRACES_ENDPOINT"] == "", name  # no spans unless asked
    for name in MONITORING | TRACING:
        ports = published(resolved[name])
        assert ports and all(ip == "127.0.0.1" for ip, _ in ports), (name, ports)
        tag = resolved[name]["image"].partition(":")[2]
        assert tag and tag != "latest", f"{name}: pin the image's version"
    assert {t for _, t in published(resolved["prometheus"])} == {"9090"}
    assert {t for _, t in published(resolved["grafana"])} == {"3000"}
    assert {t for _, t in published(resolved["jaeger"])} == {"16686"}


def test_one_env_line_turns_tracing_on(tmp_path: Path) -> None:
    endpoint = "http://jaeger:4318"
    env = {**ENV, "RADIXSERVE_OTLP_TRACES_ENDPOINT": endpoint}
    resolved = config(tmp_path, env, "tracing")["services"]
    for name in SERVICES:
        assert resolved[name]["environment"]["RADIXSERVE_OTLP_TRACES_ENDPOINT"] == endpoint


def test_each_service_parses_its_command_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """What each container would run, through its service's own argument parser."""
    import importlib

    resolved = config(tmp_path, ENV)["services"]
    for name in SERVICES:
        spec = resolved[name]
        with monkeypatch.context() as m:
            for var, value in spec["environment"].items():
                m.setenv(var, value)
            module = importlib.import_module(f"services.{name}.main")
            argv = spec["command"][1:]
            parse = getattr(module, "parse_args", None)
            a = parse(argv) if parse is not None else module.build_parser().parse_args(argv)
        assert a.metrics_port == 9090, name
        assert (a.otlp_traces_endpoint, a.otlp_traces_protocol) == ("", "http/protobuf"), name
