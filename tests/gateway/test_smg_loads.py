"""SMG's GetLoads from executor heartbeats: SGLang's token usage (a warm cache is not load:
SMG turns a worker away at 0.8), ranks by instance order, sections, and refusals."""

from __future__ import annotations

import pytest

from services.gateway.errors import ApiError
from services.gateway.grpc.smg_loads import loads_response
from shared.messages.heartbeat import ExecutorLoad


def load(**kw: int) -> ExecutorLoad:
    base = dict(waiting=2, running=3, free_kv_tokens=100, total_kv_tokens=1000, max_running=8)
    return ExecutorLoad(stream="s", model="m", context_length=4096, **{**base, **kw})


def test_token_usage_counts_what_requests_hold_not_the_evictable_cache() -> None:
    warm = load(free_kv_tokens=100, cached_tokens=850, evictable_tokens=800)
    (rank,) = loads_response([warm], ["core"], None).loads
    assert rank.num_used_tokens == 1000 - 100 - 800
    assert rank.token_usage == pytest.approx(0.1)
    assert (rank.num_running_reqs, rank.num_waiting_reqs, rank.num_total_reqs) == (3, 2, 5)
    assert rank.utilization == pytest.approx(3 / 8) and rank.max_running_requests == 8
    assert not rank.HasField("memory")


def test_ranks_sections_and_the_aggregate() -> None:
    loads = [load(running=1, waiting_tokens=40), load(running=5)]
    out = loads_response(loads, [], None)  # no sections named: all of them
    assert [r.dp_rank for r in out.loads] == [0, 1] and out.dp_rank_count == 2
    assert out.loads[0].num_waiting_uncached_tokens == 40
    assert out.loads[0].memory.token_capacity == 1000 and out.loads[0].queues.waiting == 2
    assert out.aggregate.total_running_reqs == 6 and out.aggregate.total_reqs == 10
    only = loads_response(loads, ["core"], 1)
    assert [r.dp_rank for r in only.loads] == [1] and only.dp_rank_count == 2


def test_unknown_sections_and_ranks_are_refused() -> None:
    with pytest.raises(ApiError) as e:
        loads_response([load()], ["core", "gpu"], None)
    assert e.value.param == "include" and "gpu" in e.value.message
    with pytest.raises(ApiError) as e:
        loads_response([load()], [], 3)
    assert e.value.param == "dp_rank"
