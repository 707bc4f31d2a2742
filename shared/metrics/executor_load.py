"""SGLang's executor gauges, read from an executor's load (`ExecutorLoad`, what its heartbeat
carries): the executor's own collector and the gateway's (for executors that serve no metrics
of their own: services/gateway/executor_gauges.py) report the same names the same way."""

from __future__ import annotations

from shared.messages.heartbeat import ExecutorLoad


def load_gauges(load: ExecutorLoad) -> list[tuple[str, str, float]]:
    """(name, help, value) of each gauge the load determines."""
    used = load.total_kv_tokens - load.free_kv_tokens - load.evictable_tokens
    usage = used / load.total_kv_tokens if load.total_kv_tokens else 0.0
    return [
        ("sglang:num_running_reqs", "Requests prefilling or decoding", load.running),
        ("sglang:num_queue_reqs", "Requests waiting for a step to admit them", load.waiting),
        ("sglang:num_used_tokens", "KV slots held by requests (not only by the cache)", used),
        ("sglang:max_total_num_tokens", "KV slots in the pool", load.total_kv_tokens),
        ("sglang:token_usage", "Fraction of the KV pool held by requests", usage),
        (
            "radixserve:executor_cached_kv_tokens",
            "KV slots the radix cache holds",
            load.cached_tokens,
        ),
    ]
