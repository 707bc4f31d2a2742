"""Liveness keys: every instance refreshes f"rs:live:{service}:{instance}" with a TTL."""

from __future__ import annotations

import msgspec


class ExecutorLoad(msgspec.Struct, kw_only=True, frozen=True):
    """What the scheduler routes by, refreshed with every executor heartbeat."""

    stream: str
    model: str
    context_length: int
    waiting: int
    running: int
    free_kv_tokens: int
    total_kv_tokens: int
    cached_tokens: int = 0
    evictable_tokens: int = 0
    max_running: int = 0
    grammar_requests: int = 0  # constrained requests since start
    grammar_cache_hits: int = 0  # compiled grammars found in this executor's memory
    grammar_fetched: int = 0  # compiled grammars loaded from Redis
    grammar_load_s: float = 0.0  # time spent loading (or compiling) grammars
    jump_forward_tokens: int = 0  # forced tokens appended, never sampled (no mask, no draw)
    jump_extended_tokens: int = 0  # of those, computed beside another token: passes saved
    waiting_tokens: int = 0  # prompt tokens of the requests waiting to start (gateway admission)
    aborted_requests: int = 0  # requests ended early since start (aborts, deadlines, restarts)
    tp_size: int = 1  # the ranks (GPUs) its model is split over (tensor parallelism)
    gen_throughput: float = 0.0  # tokens generated per second, over its recent heartbeats


class ModelInfo(msgspec.Struct, kw_only=True, frozen=True):
    """The served model as the tokenizer loaded it, in every tokenizer heartbeat, so the
    gateway can describe it (GET /get_model_info) without loading anything itself."""

    path: str  # the HF directory or .gguf file
    name: str  # the served name
    architecture: str  # as the checkpoint names it: config.json's, or GGUF general.architecture
    context_length: int
    vocab_size: int  # the tokenizer's ids, special tokens included
    eos_token_ids: list[int]
    has_chat_template: bool


class Heartbeat(msgspec.Struct, kw_only=True, frozen=True):
    service: str
    instance: str
    pid: int
    started: float
    ts: float
    executor: ExecutorLoad | None = None
    model: ModelInfo | None = None  # tokenizers only
    metrics_port: int = 0  # where it serves /metrics and /health (0: nowhere)
