"""`radixserve` gateway process: flags, then the aiohttp site inside the Service skeleton."""

from __future__ import annotations

import argparse
import asyncio
import logging

from services.gateway.access_policy import AccessPolicy, keys_problem
from services.gateway.app import STATE, bound_port, build_app, start_site
from services.gateway.metrics import Buckets
from services.gateway.reasoning import PARSERS
from services.gateway.state import GatewaySettings
from services.gateway.tools import PARSERS as TOOL_PARSERS
from shared.config import (
    EnvArgumentParser,
    add_common_flags,
    increasing,
    non_negative,
    positive,
)
from shared.logs import setup_logging
from shared.model_files import ModelNotFoundError, resolve_model
from shared.service import default_instance_id, run_async, service_from_flags

log = logging.getLogger(__name__)


def port_number(value: int) -> str | None:
    return None if 0 <= value <= 65535 else "must be a TCP port (0 to 65535)"


def grpc_port_number(value: int) -> str | None:
    return None if -1 <= value <= 65535 else "must be -1 (off) or a TCP port (0 to 65535)"


def build_parser() -> EnvArgumentParser:
    p = EnvArgumentParser(prog="radixserve gateway", description="radixserve HTTP gateway")
    add_common_flags(p)
    add_flags(p)
    return p


def add_flags(p: EnvArgumentParser) -> None:
    """The gateway's own flags (`radixserve serve` takes them too)."""
    p.add_flag("--host", default="127.0.0.1", help="address to listen on")
    p.add_flag("--port", type=int, default=8000, check=port_number, help="port to listen on")
    p.add_flag(
        "--grpc-port",
        type=int,
        default=-1,
        check=grpc_port_number,
        help="also serve gRPC on this port (SMG's SGLang worker protocol, radixserve.v1."
        "RadixServe, grpc.health.v1, reflection); -1: off, 0: any free port",
    )
    p.add_bool(
        "--reuse-port",
        help="share --port and --grpc-port with other gateway processes of this user "
        "(SO_REUSEPORT): the kernel spreads new connections over them, a connection staying "
        "with the process that accepted it. Off: a port in use is an error. `radixserve "
        "serve --gateway-replicas N` sets it on each of N > 1 gateways",
    )
    p.add_flag(
        "--request-timeout",
        type=float,
        default=600.0,
        check=positive,
        help="seconds a request may take end to end before it is aborted (504)",
    )
    p.add_flag(
        "--drain-timeout",
        type=float,
        default=30.0,
        check=non_negative,
        help="seconds in-flight requests may take to finish after SIGTERM",
    )
    p.add_flag(
        "--max-inflight",
        type=int,
        default=4096,
        check=positive,
        help="requests in flight at once through this gateway; more get 503 with Retry-After. "
        "Each gateway counts its own: `serve --gateway-replicas N` admits up to N times this "
        "(--max-queued-tokens is the limit over the whole stack)",
    )
    p.add_flag(
        "--max-queued-tokens",
        type=int,
        default=1_000_000,
        check=non_negative,
        help="prompt tokens waiting to start in the executors (from their heartbeats) past "
        "which new requests get 503 with Retry-After; 0: no limit",
    )
    p.add_flag(
        "--max-request-bytes",
        type=int,
        default=GatewaySettings.max_body_bytes,
        check=positive,
        help="largest request body; a larger one gets 413, from Content-Length before it is "
        "read or as a chunked body passes the limit",
    )
    p.add_flag(
        "--max-prompt-chars",
        type=int,
        default=GatewaySettings.max_prompt_chars,
        check=non_negative,
        help="characters a prompt (or /tokenize input) may have; a longer one gets 400 before "
        "it is tokenized (default: a 131,072-token context at 32 characters a token; 0: no limit)",
    )
    p.add_flag(
        "--api-key",
        default="",
        check=keys_problem,
        help="comma-separated keys the API needs as `Authorization: Bearer <key>` "
        "(prefer the environment variable: flags show in `ps`)",
    )
    p.add_flag(
        "--admin-api-key",
        default="",
        check=keys_problem,
        help="comma-separated keys for /flush_cache, the full /get_server_info, and "
        "aborting other callers' requests",
    )
    p.add_flag(
        "--max-inflight-per-key",
        type=int,
        default=0,
        check=non_negative,
        help="generation calls one API key may have in flight on this gateway; more get 429 "
        "(0: no limit). Each gateway counts its own, as --max-inflight",
    )
    for name, default in vars(Buckets()).items():
        p.add_flag(
            "--bucket-" + name.replace("_", "-"),
            type=float,
            nargs="+",
            default=list(default),
            check=increasing,
            help=f"boundaries (seconds) of the {name.replace('_', ' ')} histogram, as "
            "SGLang's flag takes them",
        )
    p.add_flag(
        "--reasoning-parser",
        default="",
        choices=["", *PARSERS],
        help="split a reasoning model's thinking from its answer in chat completions "
        "(message.reasoning_content); qwen3-thinking: Qwen3 Thinking-2507 models",
    )
    p.add_flag(
        "--tool-call-parser",
        default="",
        choices=["", *TOOL_PARSERS],
        help="the format the model writes tool calls in, for tool_choice auto (required and "
        "named functions are constrained by the grammar and need none)",
    )
    p.add_bool(
        "--serve-before-ready",
        help="pass API requests on before every stage is live (default: 503 with Retry-After "
        "until GET /health first says a request can be served end to end)",
    )


def buckets_of(a: argparse.Namespace) -> Buckets:
    return Buckets(**{name: tuple(getattr(a, f"bucket_{name}")) for name in vars(Buckets())})


class Gateway:
    """One gateway instance: the HTTP site plus its liveness key, drained on SIGTERM."""

    def __init__(self, args: argparse.Namespace, model_name: str, model_path: str = "") -> None:
        self.args = args
        # The Service's own drain outlasts the HTTP drain, so the site always shuts down itself.
        self.service = service_from_flags(
            "gateway", args, model_name, drain_timeout_s=args.drain_timeout + 5
        )
        self.settings = GatewaySettings(
            redis_url=args.redis_url,
            instance_id=self.service.instance,
            model_name=model_name,
            request_timeout_s=args.request_timeout,
            max_inflight=args.max_inflight,
            max_queued_tokens=args.max_queued_tokens,
            max_body_bytes=args.max_request_bytes,
            max_prompt_chars=args.max_prompt_chars,
            model_path=model_path,
            wait_until_ready=not args.serve_before_ready,
            detokenizer_partitions=args.detokenizer_partitions,
            reasoning_parser=args.reasoning_parser,
            tool_call_parser=args.tool_call_parser,
            is_embedding=args.is_embedding,
        )
        # Only the keys' digests are kept past this point (not in settings: they are shown).
        self.access = AccessPolicy.from_flags(
            args.api_key, args.admin_api_key, args.max_inflight_per_key
        )
        self.port: int | None = None  # the bound port, once serving
        self.grpc_port: int | None = None  # the bound gRPC port, once serving (with --grpc-port)
        self.serving = asyncio.Event()

    async def serve_http(self) -> None:
        app = await build_app(
            self.settings,
            self.service.r,
            self.access,
            self.service.metrics,
            buckets_of(self.args),
            self.service.tracing,
        )
        runner = await start_site(
            app, self.args.host, self.args.port, self.args.drain_timeout, self.args.reuse_port
        )
        state = app[STATE]
        assert state.listener is not None
        self.port = bound_port(runner)
        url = f"http://{self.args.host}:{self.port}"
        grpc_server = None
        if self.args.grpc_port >= 0:
            from services.gateway.grpc.server import GrpcServer

            grpc_server = GrpcServer(
                state,
                self.args.host,
                self.args.grpc_port,
                self.args.drain_timeout,
                self.args.reuse_port,
            )
            try:
                self.grpc_port = await grpc_server.start()
            except BaseException:
                await runner.cleanup()
                raise
            url += f" and gRPC on {self.args.host}:{self.grpc_port}"
        log.info("listening on %s; waiting until every stage is ready", url)
        self.serving.set()
        stopping = asyncio.create_task(self.service.stopping.wait())
        announce = asyncio.create_task(self._announce_ready(state.ready, url))
        try:
            watched = {state.listener} | ({state.load_watch} if state.load_watch else set())
            done, _ = await asyncio.wait(watched | {stopping}, return_when=asyncio.FIRST_COMPLETED)
            for task in done & watched:  # they only end by failing: stop the service loudly
                error = None if task.cancelled() else task.exception()
                raise RuntimeError(f"the gateway's {task.get_name()} stopped") from error
        finally:
            stopping.cancel()
            announce.cancel()
            state.draining = True
            stops = [runner.cleanup()]  # stop accepting; in-flight requests finish or time out
            if grpc_server is not None:
                stops.append(grpc_server.stop())
            await asyncio.gather(*stops)

    async def _announce_ready(self, ready: asyncio.Event, url: str) -> None:
        await ready.wait()
        log.info("ready: serving %s on %s", self.settings.model_name, url)

    async def run(self) -> None:
        await self.service.run(self.serve_http)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        model = resolve_model(args.model, args.served_model_name)
    except ModelNotFoundError as e:
        parser.error(str(e))
    setup_logging("gateway", args.instance_id or default_instance_id(), args.log_level)

    async def run() -> None:
        await Gateway(args, model.name, model.path).run()

    run_async(run)


if __name__ == "__main__":
    main()
