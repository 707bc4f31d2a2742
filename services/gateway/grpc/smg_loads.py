"""SMG's GetLoads answer from the executors' heartbeats: one SchedulerLoad per executor (its
`dp_rank` is its place in the instance-name order), and the aggregate.

Token usage is SGLang's: KV slots held by requests, not those the prefix cache keeps but could
evict, over the pool. SMG stops routing to a worker at 0.8 (its overload veto), so counting a
warm cache as use would turn every warm worker away.
"""

from __future__ import annotations

from datetime import UTC, datetime

from smg_grpc_proto.generated import sglang_scheduler_pb2 as sgl

import radixserve
from services.gateway.errors import invalid
from shared.messages.heartbeat import ExecutorLoad

SECTIONS = frozenset({"core", "memory", "spec", "lora", "disagg", "queues", "all"})


def used_tokens(load: ExecutorLoad) -> int:
    return max(0, load.total_kv_tokens - load.free_kv_tokens - load.evictable_tokens)


def scheduler_load(rank: int, load: ExecutorLoad, sections: set[str]) -> sgl.SchedulerLoad:
    used = used_tokens(load)
    out = sgl.SchedulerLoad(
        dp_rank=rank,
        num_running_reqs=load.running,
        num_waiting_reqs=load.waiting,
        num_total_reqs=load.running + load.waiting,
        num_used_tokens=used,
        max_total_num_tokens=load.total_kv_tokens,
        token_usage=used / load.total_kv_tokens if load.total_kv_tokens else 0.0,
        utilization=load.running / load.max_running if load.max_running else 0.0,
        max_running_requests=load.max_running,
        num_waiting_uncached_tokens=load.waiting_tokens,
    )
    if sections & {"memory", "all"}:
        out.memory.CopyFrom(sgl.MemoryMetrics(token_capacity=load.total_kv_tokens))
    if sections & {"queues", "all"}:
        out.queues.CopyFrom(sgl.QueueMetrics(waiting=load.waiting))
    if sections & {"disagg", "all"}:
        out.disaggregation.CopyFrom(sgl.DisaggregationMetrics(mode="null"))
    return out


def loads_response(
    loads: list[ExecutorLoad], include: list[str], dp_rank: int | None
) -> sgl.GetLoadsResponse:
    """`include`: the sections asked for (none: all); `dp_rank`: only that executor."""
    unknown = sorted(set(include) - SECTIONS)
    if unknown:
        raise invalid(
            f"include has unknown sections {unknown}; known: {sorted(SECTIONS)}", "include"
        )
    sections = set(include) or {"all"}
    ranked = list(enumerate(loads))
    if dp_rank is not None:
        if not 0 <= dp_rank < len(loads):
            raise invalid(f"dp_rank {dp_rank} is not one of the {len(loads)} executors", "dp_rank")
        ranked = [ranked[dp_rank]]
    per_rank = [scheduler_load(i, load, sections) for i, load in ranked]
    n = max(1, len(per_rank))
    return sgl.GetLoadsResponse(
        timestamp=datetime.now(UTC).isoformat(),
        version=f"radixserve-{radixserve.__version__}",
        dp_rank_count=len(loads),
        loads=per_rank,
        aggregate=sgl.AggregateMetrics(
            total_running_reqs=sum(x.num_running_reqs for x in per_rank),
            total_waiting_reqs=sum(x.num_waiting_reqs for x in per_rank),
            total_reqs=sum(x.num_total_reqs for x in per_rank),
            avg_token_usage=sum(x.token_usage for x in per_rank) / n,
            avg_utilization=sum(x.utilization for x in per_rank) / n,
        ),
    )
