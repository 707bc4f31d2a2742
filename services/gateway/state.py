"""What every handler reaches through `request.app[STATE]`."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from aiohttp import web

from services.gateway.access_policy import AccessPolicy
from services.gateway.dispatch import Dispatcher
from services.gateway.key_budget import KeyBudget
from services.gateway.readiness import Readiness
from services.gateway.replies import ReplyRouter


@dataclass(frozen=True)
class GatewaySettings:
    redis_url: str
    instance_id: str  # names this gateway's reply stream: keep it unique among live gateways
    model_name: str  # the served model's name in the API
    request_timeout_s: float = 600.0
    max_inflight: int = 4096
    max_queued_tokens: int = 0  # prompt tokens waiting in the executors; 0: no limit
    max_body_bytes: int = 16 * 1024 * 1024  # --max-request-bytes: see input_limits.py
    max_prompt_chars: int = 131_072 * 32  # --max-prompt-chars: see input_limits.py
    model_path: str = ""  # the HF directory or .gguf file, as --model resolved here
    wait_until_ready: bool = False  # refuse API requests (503) until the stack is first ready
    # Readiness requires a live owner for each of these detokenizer partitions (0: any
    # live detokenizer will do).
    detokenizer_partitions: int = 0
    # --reasoning-parser: splits chat answers' thinking part into reasoning_content ("": none)
    reasoning_parser: str = ""
    # --tool-call-parser: the format chat answers' tool calls are read in ("": tool_choice
    # "auto" is refused; "required" and named functions need none)
    tool_call_parser: str = ""
    is_embedding: bool = False  # --is-embedding: /v1/embeddings only (embeddings_api.py)


@dataclass
class GatewayState:
    settings: GatewaySettings
    r: aioredis.Redis
    router: ReplyRouter
    dispatcher: Dispatcher
    access: AccessPolicy = field(default_factory=AccessPolicy)  # default: no keys, all open
    key_budget: KeyBudget = field(default_factory=lambda: KeyBudget(0))
    started: float = field(default_factory=time.time)
    listener: asyncio.Task[None] | None = None  # the reply router's task, while the app runs
    load_watch: asyncio.Task[None] | None = None  # keeps admission's executor load current
    draining: bool = False  # set at shutdown: new requests get 503
    ready: asyncio.Event = field(default_factory=asyncio.Event)  # the stack was ready once
    readiness: Readiness | None = None  # the last one read while waiting for `ready`


STATE = web.AppKey("state", GatewayState)
