"""compose.yaml with the .env that scripts/make_env.sh writes: Redis needs the generated password,
every service connects with it, and only the gateway is published (on 127.0.0.1), besides the
opt-in monitoring and tracing tools (on 127.0.0.1 only; tests/deploy checks their profiles)."""

from __future__ import annotations

import re
import stat
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml
from redis.connection import parse_url

from services.executor.models import gemv_plans
from shared import caches, tokenizer_cache

ROOT = Path(__file__).resolve().parents[1]
_VAR = re.compile(r"\$\{(\w+)(?::([-?])([^}]*))?\}")


def make_env(path: Path) -> str:
    done = subprocess.run(
        ["bash", str(ROOT / "scripts" / "make_env.sh"), str(path)],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout


def read_env(path: Path) -> dict[str, str]:
    lines = path.read_text().splitlines()
    pairs = (line.split("=", 1) for line in lines if line and not line.startswith("#"))
    return {k: v for k, v in pairs}


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's `${VAR}`, `${VAR:-default}` and `${VAR:?error}` over a parsed file."""
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if not isinstance(value, str):
        return value

    def one(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2), m.group(3)
        if env.get(name):
            return env[name]
        if op == "?":
            raise LookupError(f"{name}: {arg}")
        return arg if op == "-" else ""

    return _VAR.sub(one, value)


def compose(env: dict[str, str]) -> dict[str, Any]:
    services: dict[str, Any] = yaml.safe_load((ROOT / "compose.yaml").read_text())["services"]
    return {name: interpolate(spec, env) for name, spec in services.items()}


def test_make_env_generates_a_private_password_and_never_overwrites(tmp_path: Path) -> None:
    path = tmp_path / ".env"
    assert "wrote" in make_env(path)
    first = path.read_text()
    env = read_env(path)
    assert re.fullmatch(r"[0-9a-f]{64}", env["REDIS_PASSWORD"])
    assert env["RADIXSERVE_API_KEY"] == "" and env["GATEWAY_BIND"] == "127.0.0.1"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert "left as it is" in make_env(path)
    assert path.read_text() == first
    other = tmp_path / "other.env"
    make_env(other)
    assert read_env(other)["REDIS_PASSWORD"] != env["REDIS_PASSWORD"]  # not a fixed default
    mine = tmp_path / "mine.env"
    mine.write_text("REDIS_PASSWORD=chosen\n")
    make_env(mine)
    assert mine.read_text() == "REDIS_PASSWORD=chosen\n"


def test_compose_needs_the_password_and_publishes_only_the_gateway(tmp_path: Path) -> None:
    make_env(tmp_path / ".env")
    env = read_env(tmp_path / ".env")
    env["RADIXSERVE_API_KEY"] = "k1,k2"
    services = compose(env)
    password = env["REDIS_PASSWORD"]
    redis = services["redis"]
    assert "ports" not in redis and "network_mode" not in redis
    command = redis["command"]
    assert command[command.index("--requirepass") + 1] == password
    assert redis["environment"]["REDISCLI_AUTH"] == password  # its healthcheck authenticates
    clients = {n: spec for n, spec in services.items() if spec.get("image") == "radixserve:latest"}
    assert set(clients) >= {"gateway", "tokenizer", "scheduler", "executor", "detokenizer"}
    for name, spec in clients.items():
        url = parse_url(spec["environment"]["REDIS_URL"])
        assert (url["host"], url["password"]) == ("redis", password), name
        assert ("ports" in spec) == (name == "gateway"), name
    tools = set(services) - set(clients) - {"redis"}
    assert tools == {"prometheus", "grafana", "jaeger"}
    for name in tools:
        assert services[name]["profiles"], f"{name} would start with a plain `up`"
        assert all(p.startswith("127.0.0.1:") for p in services[name]["ports"]), name
    assert services["gateway"]["ports"] == ["127.0.0.1:8000:8000", "127.0.0.1:50051:50051"]
    command = services["gateway"]["command"]
    assert command[command.index("--grpc-port") + 1] == "50051"
    assert services["gateway"]["environment"]["RADIXSERVE_API_KEY"] == "k1,k2"
    assert "RADIXSERVE_API_KEY" not in services["tokenizer"]["environment"]


def test_compose_refuses_to_start_without_a_password() -> None:
    with pytest.raises(LookupError, match=r"REDIS_PASSWORD: run scripts/make_env\.sh"):
        compose({})


def test_install_writes_the_env_the_image_runs_unprivileged_and_env_is_ignored() -> None:
    assert "make_env.sh" in (ROOT / "scripts" / "install.sh").read_text()
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    users = [line.split()[1] for line in dockerfile if line.startswith("USER ")]
    assert users and users[-1] not in ("root", "0")
    ignored = subprocess.run(
        ["git", "check-ignore", "-q", ".env"], cwd=ROOT, check=False
    ).returncode
    assert ignored == 0


def test_every_service_shares_one_cache_volume_the_image_user_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One named volume at the image user's default cache directory, in every radixserve
    service: replicas and restarts load the tokenizer the first service saved, the gemv
    choices the first executor timed and the kernels it compiled."""
    make_env(tmp_path / ".env")
    services = compose(read_env(tmp_path / ".env"))
    home = "/home/radixserve"
    mount = f"radixserve-cache:{home}/.cache/radixserve"
    clients = {n: spec for n, spec in services.items() if spec.get("image") == "radixserve:latest"}
    assert clients and all(mount in spec["volumes"] for spec in clients.values())
    assert "radixserve-cache" in yaml.safe_load((ROOT / "compose.yaml").read_text())["volumes"]
    monkeypatch.setenv("HOME", home)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.delenv(caches.CACHE_ENV, raising=False)
    assert tokenizer_cache.cache_root() == Path(home, ".cache", "radixserve", "tokenizers")
    # the executor's gemv choices and Triton's compiled kernels live on the volume as well
    assert gemv_plans.cache_dir() == Path(home, ".cache", "radixserve", "gemv")
    for spec in clients.values():
        triton = Path(spec["environment"]["TRITON_CACHE_DIR"])
        assert triton.is_relative_to(Path(home, ".cache", "radixserve"))
    # made by the image's user, so the new volume is that user's (Docker copies ownership)
    dockerfile = (ROOT / "Dockerfile").read_text().splitlines()
    made = dockerfile.index(f"RUN mkdir -p {home}/.cache/radixserve")
    assert dockerfile.index("USER radixserve") < made


def test_the_multinode_override_splits_one_executor_over_two_hosts(tmp_path: Path) -> None:
    make_env(tmp_path / ".env")
    env = {**read_env(tmp_path / ".env"), "NODE0_ADDR": "10.0.0.1"}
    raw = yaml.safe_load((ROOT / "compose.multinode.yaml").read_text())["services"]
    services = {name: interpolate(spec, env) for name, spec in raw.items()}

    def flags(command: list[str]) -> dict[str, str]:
        return dict(zip(command[1::2], command[2::2], strict=False))

    node0, node1 = (
        flags(services["executor"]["command"]),
        flags(services["executor-node1"]["command"]),
    )
    for node in (node0, node1):
        assert (node["--tp-size"], node["--nnodes"]) == ("2", "2")
        assert node["--dist-init-addr"] == "10.0.0.1:29500"
    assert (node0["--node-rank"], node1["--node-rank"]) == ("0", "1")
    assert "REDIS_URL" not in services["executor-node1"]["environment"]  # it never reads the bus
    assert services["executor-node1"]["profiles"] == ["node1"]
    from services.executor.main import parse_args

    for command in (services["executor"]["command"], services["executor-node1"]["command"]):
        a = parse_args(command[1:])  # the executor takes these flags
        assert a.tp_size == 2 and a.nnodes == 2
