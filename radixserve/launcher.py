"""`radixserve serve`: every service on this machine, as its own supervised process.

Starts a private redis-server (password-protected, on a private unix socket) when no REDIS_URL
is given, then each service with the same `radixserve <service>` command compose.yaml runs,
passing the configuration through the services' RADIXSERVE_* environment twins. Shows the
model's load progress, prints a ready line once GET /health says a request can be served end
to end, restarts a child (or its Redis) that dies, and on Ctrl-C / SIGTERM stops the services
(gateway first), then Redis.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import os
import signal
import socket
import sys
import time
import urllib.error
import urllib.request

import redis

from radixserve.children import ChildSpec
from radixserve.progress import ProgressDisplay, read_progress
from radixserve.redis_proc import RedisServer
from radixserve.restart import RestartPolicy
from radixserve.spawner import Zygote, zygote_supported
from radixserve.supervisor import Supervisor
from radixserve.teardown import exit_without_teardown
from shared import constants
from shared.config import EnvArgumentParser, add_common_flags, env_name, non_negative, positive
from shared.model_files import ModelNotFoundError, resolve_model

# serve prints it once the whole stack serves (harnesses wait for it: before it, a child that
# exits fails the start and serve stops everything)
READY_MESSAGE = "radixserve is serving"
SERVICE_ORDER = ["scheduler", "detokenizer", "tokenizer", "grammar", "executor", "gateway"]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    from services.executor.flags import add_flags as executor_flags
    from services.gateway.main import add_flags as gateway_flags
    from services.grammar.flags import add_flags as grammar_flags
    from services.scheduler.main import add_flags as scheduler_flags
    from services.tokenizer.main import add_flags as tokenizer_flags

    p = EnvArgumentParser(prog="radixserve serve", description=__doc__)
    add_common_flags(p)
    for add in (gateway_flags, tokenizer_flags, grammar_flags, scheduler_flags, executor_flags):
        add(p)
    p.add_flag(
        "--tokenizer-replicas", type=int, default=1, check=positive, help="tokenizer processes"
    )
    p.add_flag(
        "--gateway-replicas",
        type=int,
        default=1,
        check=positive,
        help="gateway processes, sharing --port (and --grpc-port) through SO_REUSEPORT: the "
        "kernel spreads new connections over them. Each has its own --max-inflight and "
        "--max-inflight-per-key counts, and answers /metrics on the API port for itself "
        "(--metrics-port gives each its own port to scrape)",
    )
    p.add_flag(
        "--dp-size",
        type=int,
        default=1,
        check=positive,
        help="executor processes (data parallelism; the scheduler routes between them, see "
        "--load-balance-method). On CUDA executor i runs on GPU (--device's index + i), "
        "sharing GPUs when there are fewer; executors that share a GPU each need "
        "--max-total-tokens",
    )
    p.add_flag(
        "--max-restarts",
        type=int,
        default=5,
        check=non_negative,
        help="restarts of one child within --restart-window before everything stops (exit 1)",
    )
    p.add_flag(
        "--restart-window",
        type=float,
        default=300.0,
        check=positive,
        help="seconds over which --max-restarts counts a child's restarts",
    )
    p.add_bool(
        "--preload",
        default=True,
        help="fork the services (Linux) from one process that has imported their modules "
        "(radixserve/zygote.py): the stack imports torch and the rest once, and a restarted "
        "service skips its imports (seconds of CPU each). --no-preload starts every service "
        "from its own command, as compose does",
    )
    p.add_flag(
        "--startup-timeout",
        type=float,
        default=600.0,
        check=positive,
        help="seconds to wait for every service to be ready",
    )
    a = p.parse_args(argv)
    for flag, port in (("--port", a.port), ("--grpc-port", a.grpc_port)):
        if port == 0 and a.gateway_replicas > 1:
            p.error(
                f"{flag} 0 would give each of the --gateway-replicas its own free port; name "
                "the port they share"
            )
    gpus = _gpu_count(a.device) if a.dp_size > 1 or a.tp_size > 1 else 0
    if gpus and a.tp_size > gpus and a.nnodes == 1:
        p.error(f"--tp-size {a.tp_size} needs {a.tp_size} GPUs; this machine has {gpus}")
    a.executor_devices = executor_devices(a.device, a.dp_size, gpus, a.tp_size // a.nnodes)
    cuda = [
        f"cuda:{device_index(d) + r}"
        for d in a.executor_devices
        if d.startswith("cuda")
        for r in range(a.tp_size // a.nnodes)
    ]
    if len(cuda) > len(set(cuda)) and a.max_total_tokens <= 0:
        p.error(
            f"{a.dp_size} executors would share a GPU ({', '.join(a.executor_devices)}): give "
            "each its KV pool with --max-total-tokens (--mem-fraction-static sizes a pool from "
            "the memory free when it is measured, so the first executor would take what the "
            "others need)"
        )
    if "REDIS_URL" not in os.environ and a.redis_url == "redis://127.0.0.1:6379/0":
        a.redis_url = ""  # nothing given: run a private Redis
    return a


def _gpu_count(device: str) -> int:
    if device == "cpu":
        return 0
    import torch

    return torch.cuda.device_count()


def device_index(device: str) -> int:
    """The GPU index of "cuda:K" (K), or 0 for a device that names none ("cuda", "auto")."""
    index = device.partition(":")[2]
    return int(index) if index.isdigit() else 0


def executor_devices(device: str, dp_size: int, gpu_count: int, tp_per_node: int = 1) -> list[str]:
    """The --device of each of `dp_size` executors: on CUDA its first GPU, from --device's
    index up, each executor taking `tp_per_node` GPUs (its tensor-parallel ranks on this node:
    cuda:K, cuda:K+T, ...), going round again over those GPUs when there are fewer;
    otherwise (the CPU, or no GPU) `device` for all."""
    if device == "cpu" or gpu_count == 0 or not device.startswith(("cuda", "auto")):
        return [device] * dp_size
    base = device_index(device)
    span = max(1, (gpu_count - base) // tp_per_node)  # whole groups from the base up
    return [f"cuda:{base + (i % span) * tp_per_node}" for i in range(dp_size)]


def check_model(a: argparse.Namespace) -> str:
    """Fail before starting anything when the model cannot be served; returns its name."""
    from services.executor.errors import ModelLoadError, UnsupportedModelError
    from services.executor.model_config import ModelConfig

    try:
        source = resolve_model(a.model, a.served_model_name)
        if source.kind == "gguf":
            from services.executor.weights.gguf import open_gguf  # torch, for GGUF files only

            ModelConfig.from_gguf(open_gguf(source.path))
        else:
            ModelConfig.from_hf_dir(source.path)
    except (ModelNotFoundError, ModelLoadError, UnsupportedModelError) as e:
        raise SystemExit(f"radixserve serve: cannot serve this model: {e}") from None
    return source.name


def child_env(a: argparse.Namespace) -> dict[str, str]:
    env = dict(os.environ)
    for key, value in vars(a).items():
        if value is None or key == "executor_devices":
            continue
        if isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, list | tuple):
            text = " ".join(map(str, value))
        else:
            text = str(value)
        env[env_name("--" + key.replace("_", "-"))] = text
    env["REDIS_URL"] = a.redis_url
    env.pop("RADIXSERVE_REDIS_URL", None)
    env.pop("RADIXSERVE_INSTANCE_ID", None)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def child_specs(a: argparse.Namespace, suffix: str = "") -> list[ChildSpec]:
    """Every child, in start order; each runs the `radixserve <service>` command compose.yaml
    runs. `suffix` keeps instance ids unique when other launches share the Redis."""
    env = child_env(a)
    cmd = [sys.executable, "-m", "radixserve"]
    specs: list[ChildSpec] = []
    port = a.metrics_port  # each child its own: the next free one from here, in start order
    for service in SERVICE_ORDER:
        count = {
            "tokenizer": a.tokenizer_replicas,
            "detokenizer": a.detokenizer_partitions,
            "executor": a.dp_size,
            "gateway": a.gateway_replicas,
        }
        for i in range(count.get(service, 1)):
            argv = [*cmd, service]
            if service == "detokenizer":
                argv += ["--partition", str(i)]
            if service == "executor" and (a.dp_size > 1 or a.tp_size > 1):
                argv += ["--device", a.executor_devices[i]]
            if service == "gateway" and a.gateway_replicas > 1:
                argv += ["--reuse-port"]  # one port, the kernel spreading connections
            if a.metrics_port > 0:
                port = next_free_port(port)
                argv += ["--metrics-port", str(port)]
                port += 1
            specs.append(ChildSpec(f"{service}-{i}", service, argv, env, suffix))
    return specs


def next_free_port(port: int) -> int:
    """`port`, or the first one after it that nothing listens on here."""
    while True:
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                port += 1


def metrics_ports(specs: list[ChildSpec]) -> list[str]:
    """Each child given a --metrics-port, as `service-i :port`."""
    return [
        f"{spec.name} :{spec.argv[spec.argv.index('--metrics-port') + 1]}"
        for spec in specs
        if "--metrics-port" in spec.argv
    ]


def port_in_use(host: str, port: int) -> str | None:
    """Why nothing new can listen on host:port, or None. With SO_REUSEPORT the gateways would
    share a port with whatever else listens on it with that option (another launch, as the
    same user), so `main` asks first; a bad address is left for the gateway to report."""
    try:
        addresses = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the gateway binds
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(address)
            except OSError as e:
                return f"cannot listen on {address[0]}:{port}: {e.strerror or e}"
    return None


def live_count(client: redis.Redis, service: str, suffix: str) -> int:
    """Instances of `service` of this launch whose heartbeat is live (an executor beats once
    its model loaded, a gateway just before it listens)."""
    try:
        pattern = constants.live_key(service, f"*{suffix}")
        return sum(1 for _ in client.scan_iter(match=pattern, count=500))
    except redis.RedisError:
        return 0


def health_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=1) as resp:
            return bool(resp.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    # Started first, so that its imports (and its parse of a GGUF model) run beside the model
    # check below; an early exit ends it through its parent-death signal.
    zygote = Zygote(child_env(a)) if a.preload and zygote_supported() else None
    if zygote is not None:
        zygote.start()
    name = check_model(a)
    if a.gateway_replicas > 1 or a.reuse_port:
        for port in (a.port, a.grpc_port):
            problem = port > 0 and port_in_use(a.host, port)
            if problem:
                raise SystemExit(f"radixserve serve: {problem}")
    redis_server = None
    suffix = f"-{socket.gethostname()}-{os.getpid()}"
    if not a.redis_url:
        redis_server = RedisServer()
        redis_server.start()
        a.redis_url, suffix = redis_server.url, ""  # nothing else uses this Redis
    started = time.monotonic()

    def on_signal(signum: int, frame: object) -> None:
        raise KeyboardInterrupt  # SIGTERM stops everything the way Ctrl-C does

    # Both set here, whatever this process inherited: a shell script's background job
    # (`radixserve serve &`) starts with SIGINT ignored, and Python then installs no
    # KeyboardInterrupt for it, so Ctrl-C / kill -INT would not stop the stack.
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    host = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    url = f"http://{host}:{a.port}"
    display = ProgressDisplay()
    progress_client = redis.Redis.from_url(a.redis_url, socket_timeout=1)
    last_shown = [0.0]

    def show_progress() -> None:
        if time.monotonic() - last_shown[0] < 0.5:
            return
        last_shown[0] = time.monotonic()
        with contextlib.suppress(redis.RedisError):
            display.show(read_progress(progress_client))

    grpc = f" and gRPC on {host}:{a.grpc_port}" if a.grpc_port > 0 else ""

    def on_ready() -> None:
        display.end()
        print(
            f"ready: {READY_MESSAGE} {name} at {url}{grpc} (ready in "
            f"{time.monotonic() - started:.1f}s; Ctrl-C stops it)",
            flush=True,
        )

    def is_ready() -> bool:
        """Serving end to end, with every executor --dp-size asked for and every gateway."""
        return (
            health_ok(url)
            and live_count(progress_client, "executor", suffix) >= a.dp_size
            and live_count(progress_client, "gateway", suffix) >= a.gateway_replicas
        )

    specs = child_specs(a, suffix)
    scrape = metrics_ports(specs)
    if scrape:
        print("metrics (/metrics, /health) on " + ", ".join(scrape), flush=True)
    supervisor = Supervisor(
        specs,
        a.redis_url,
        is_ready=is_ready,
        on_ready=on_ready,
        on_tick=show_progress,  # an executor restarted later shows its load too
        policy=RestartPolicy(max_restarts=a.max_restarts, window_s=a.restart_window),
        redis_server=redis_server,
        startup_timeout_s=a.startup_timeout,
        zygote=zygote,
    )
    # The model check imported the executor's config code (torch with it): frozen, the
    # collector skips that heap at exit, which otherwise took most of a second of each stop.
    gc.collect()
    gc.freeze()
    try:
        code = supervisor.run()
    finally:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        progress_client.close()
    if code:
        raise SystemExit(code)
    exit_without_teardown()  # its frozen heap holds triton for a GGUF model: teardown.py
