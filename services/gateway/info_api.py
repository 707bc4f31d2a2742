"""GET /get_model_info, /get_server_info and /get_load (SGLang's): what is served, by whom, and
how busy.

The gateway loads no model, so both read the services' heartbeats: tokenizers describe the
model (shared/messages/heartbeat.py ModelInfo), executors report their context and load.
Callers without the admin right (services/gateway/access_policy.py) see no file path, URL,
instance name (host and pid) or process id: `public_model_info` and `public_server_info`.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import msgspec
from aiohttp import web
from google.protobuf import json_format

import radixserve
from services.gateway.access import caller
from services.gateway.errors import ApiError, invalid
from services.gateway.grpc.smg_loads import loads_response, used_tokens
from services.gateway.readiness import PIPELINE
from services.gateway.responses import json_response
from services.gateway.state import STATE, GatewayState
from shared import constants
from shared.bus import TRANSIENT
from shared.messages.heartbeat import ExecutorLoad, Heartbeat, ModelInfo
from shared.service import live_instances


async def _beats(state: GatewayState, services: tuple[str, ...]) -> dict[str, list[Heartbeat]]:
    try:
        return {name: await live_instances(state.r, name) for name in services}
    except TRANSIENT as e:
        raise ApiError(503, f"redis is unreachable: {e}") from e


def _by_instance(beats: list[Heartbeat]) -> list[Heartbeat]:
    """Executors' heartbeats that carry a load, in instance-name order: their ranks."""
    return sorted((b for b in beats if b.executor is not None), key=lambda b: b.instance)


def _loaded_model(tokenizers: list[Heartbeat]) -> ModelInfo | None:
    """What a live tokenizer loaded (None: no tokenizer says)."""
    return next((b.model for b in tokenizers if b.model is not None), None)


def _model_path(state: GatewayState, model: ModelInfo | None) -> str | None:
    """The served model's path: the gateway's setting, else what a live tokenizer loaded."""
    return state.settings.model_path or (model.path if model is not None else None)


async def executor_loads(state: GatewayState) -> list[ExecutorLoad]:
    """Each live executor's load from its last heartbeat, by instance name."""
    beats = (await _beats(state, ("executor",)))["executor"]
    return [b.executor for b in _by_instance(beats) if b.executor is not None]


async def get_model_info(request: web.Request) -> web.StreamResponse:
    info = await model_info(request.app[STATE])
    return json_response(info if caller(request).admin else public_model_info(info))


async def model_info(state: GatewayState) -> dict[str, Any]:
    """What a live tokenizer loaded; the context length is the executors' (they may serve less
    than the checkpoint's, e.g. a sliding-window model), else the tokenizer's. Fields nobody
    live can tell are null."""
    beats = await _beats(state, ("tokenizer", "executor"))
    model = _loaded_model(beats["tokenizer"])
    contexts = [b.executor.context_length for b in beats["executor"] if b.executor is not None]
    path = _model_path(state, model)
    if contexts:
        context: int | None = min(contexts)
    else:
        context = model.context_length if model is not None else None
    info = {
        "model_path": path,
        "tokenizer_path": path,  # the tokenizer always comes with the model here
        "served_model_name": state.settings.model_name,
        "is_generation": not state.settings.is_embedding,
        "context_length": context,
        "architecture": model.architecture if model is not None else None,
        "vocab_size": model.vocab_size if model is not None else None,
        "eos_token_ids": model.eos_token_ids if model is not None else None,
        "has_chat_template": model.has_chat_template if model is not None else None,
    }
    return info


def public_model_info(info: dict[str, Any]) -> dict[str, Any]:
    """The model's file name in place of its path."""
    out = dict(info)
    for key in ("model_path", "tokenizer_path"):
        if isinstance(out[key], str):
            out[key] = os.path.basename(out[key].rstrip("/"))
    return out


def redact(url: str) -> str:
    """A Redis URL without its password."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))


async def get_server_info(request: web.Request) -> web.StreamResponse:
    full = await server_info(request.app[STATE])
    return json_response(full if caller(request).admin else public_server_info(full))


async def server_info(state: GatewayState) -> dict[str, Any]:
    """This gateway's settings and state, every live service instance, each executor's load
    from its last heartbeat, and the scheduler leader; and the keys of SGLang's answer that
    its tools read (sglang_keys)."""
    beats = await _beats(state, ("gateway", *PIPELINE))
    try:
        leader = await state.r.get(constants.SCHEDULER_LEADER_KEY)
    except TRANSIENT as e:
        raise ApiError(503, f"redis is unreachable: {e}") from e
    settings = dataclasses.asdict(state.settings)
    settings["redis_url"] = redact(state.settings.redis_url)
    now = time.time()
    executors = _by_instance(beats["executor"])
    full = {
        "gateway": {
            **settings,
            "started": state.started,
            "inflight": len(state.dispatcher.inflight.calls),
            "draining": state.draining,
            # medians over recent requests of where their first token's time went
            "first_token_hops": state.dispatcher.hop_stats.summary(),
        },
        "scheduler_leader": leader.decode() if leader is not None else None,
        "instances": {
            name: [
                {
                    "instance": b.instance,
                    "pid": b.pid,
                    "started": b.started,
                    "heartbeat_age_s": round(now - b.ts, 3),
                }
                for b in sorted(found, key=lambda b: b.instance)
            ]
            for name, found in beats.items()
        },
        "executors": [
            {"instance": b.instance, **msgspec.to_builtins(b.executor)} for b in executors
        ],
    }
    loads = [b.executor for b in executors if b.executor is not None]
    path = _model_path(state, _loaded_model(beats["tokenizer"]))
    return {**sglang_keys(state, loads, path), **full}


def sglang_keys(state: GatewayState, loads: list[ExecutorLoad], path: str | None) -> dict[str, Any]:
    """What SGLang's tools read from its /get_server_info (its server arguments, scheduler
    info and per-rank internal states: bench_one_batch_server reads `tokenizer_path` and
    `internal_states[0].last_gen_throughput`, SGLang's router `dp_size`), per executor in
    instance order, as /get_load ranks them."""
    return {
        "model_path": path,
        "tokenizer_path": path,
        "served_model_name": state.settings.model_name,
        "dp_size": len(loads),
        "tp_size": max((x.tp_size for x in loads), default=1),
        "max_total_num_tokens": min((x.total_kv_tokens for x in loads), default=0),
        "internal_states": [
            {
                "last_gen_throughput": x.gen_throughput,
                "num_running_reqs": x.running,
                "num_waiting_reqs": x.waiting,
                "max_total_num_tokens": x.total_kv_tokens,
            }
            for x in loads
        ],
        "version": radixserve.__version__,
    }


SGLANG_KEYS = (
    "model_path",
    "tokenizer_path",
    "served_model_name",
    "dp_size",
    "tp_size",
    "max_total_num_tokens",
    "internal_states",
    "version",
)
# The gateway settings anyone may see (a list of what is shown, so a new setting stays hidden).
PUBLIC_GATEWAY = (
    "model_name",
    "request_timeout_s",
    "max_inflight",
    "max_queued_tokens",
    "max_body_bytes",
    "max_prompt_chars",
    "started",
    "inflight",
    "draining",
    "first_token_hops",
)


def public_server_info(full: dict[str, Any]) -> dict[str, Any]:
    """Load and limits without paths, URLs, instance names or process ids: the number of live
    instances of each service, and each executor's load without its name and stream."""
    sglang = {k: full[k] for k in SGLANG_KEYS}
    return {
        **public_model_info(sglang),
        "gateway": {k: full["gateway"][k] for k in PUBLIC_GATEWAY if k in full["gateway"]},
        "instances": {name: len(found) for name, found in full["instances"].items()},
        "executors": [
            {k: v for k, v in load.items() if k not in ("instance", "stream")}
            for load in full["executors"]
        ],
    }


async def get_load(request: web.Request) -> web.StreamResponse:
    """SGLang's load report, which its router balances data-parallel ranks by: per live
    executor (its rank: the place of its instance name in order), its requests running or
    waiting, those waiting, and its tokens: the KV slots in use (not free, not evictable
    cache) plus the prompts waiting to start, as SGLang's scheduler counts them."""
    loads = await executor_loads(request.app[STATE])
    return json_response(
        [
            {
                "dp_rank": rank,
                "num_reqs": load.running + load.waiting,
                "num_waiting_reqs": load.waiting,
                "num_tokens": used_tokens(load) + load.waiting_tokens,
            }
            for rank, load in enumerate(loads)
        ]
    )


async def get_loads(request: web.Request) -> web.StreamResponse:
    """SGLang's newer GET /v1/loads, which SMG's HTTP mode polls: per-rank loads and their
    aggregate, the same answer as the gRPC GetLoads (grpc/smg_loads.py), as JSON.
    `?dp_rank=N`, `?include=core,memory,...`; `format=prometheus` is refused (see /metrics)."""
    query = request.query
    if query.get("format", "json") != "json":
        raise invalid("format must be json; Prometheus metrics are at /metrics", "format")
    rank = query.get("dp_rank")
    if rank is not None and not rank.isdigit():
        raise invalid(f"dp_rank must be a non-negative integer, got {rank!r}", "dp_rank")
    include = [s.strip() for s in query.get("include", "").split(",") if s.strip()]
    loads = await executor_loads(request.app[STATE])
    answer = loads_response(loads, include, None if rank is None else int(rank))
    return json_response(
        json_format.MessageToDict(
            answer, preserving_proto_field_name=True, always_print_fields_with_no_presence=True
        )
    )


async def version(request: web.Request) -> web.StreamResponse:
    return json_response({"version": radixserve.__version__})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/get_model_info", get_model_info)
    app.router.add_get("/get_server_info", get_server_info)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/v1/loads", get_loads)
    # SGLang's newer names for the above, which SMG asks for first
    app.router.add_get("/model_info", get_model_info)
    app.router.add_get("/server_info", get_server_info)
    app.router.add_get("/version", version)
