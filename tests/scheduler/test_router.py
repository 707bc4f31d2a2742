"""Routing, the bounded queue, aborts and executor loss, without Redis."""

from __future__ import annotations

import msgspec

from services.scheduler.router import Router
from shared.messages.common import HopTimes, SamplingParams, Trace
from shared.messages.detok import RequestAborted, RequestFailed
from shared.messages.heartbeat import ExecutorLoad, Heartbeat
from shared.messages.schedule import TokenizedRequest
from shared.messages.tokenize import AbortRequest


def make_request(rid: str, n: int = 4, deadline: float = 1e12) -> TokenizedRequest:
    return TokenizedRequest(
        trace=Trace(rid=rid, reply_to="rs:reply:g", deadline=deadline),
        input_ids=list(range(n)),
        sampling=SamplingParams(),
        max_new_tokens=8,
        eos_token_ids=[0],
        detok_stream="rs:detok:0",
    )


def beat(name: str, waiting: int = 0, running: int = 0, ts: float = 1.0) -> Heartbeat:
    load = ExecutorLoad(
        stream=f"rs:exec:{name}",
        model="m",
        context_length=64,
        waiting=waiting,
        running=running,
        free_kv_tokens=100,
        total_kv_tokens=100,
    )
    return Heartbeat(service="executor", instance=name, pid=1, started=0, ts=ts, executor=load)


def test_no_executor_is_a_503() -> None:
    out = Router(max_queued=10).route(make_request("a"))
    assert len(out) == 1
    stream, msg = out[0]
    assert stream == "rs:detok:0"
    assert isinstance(msg, RequestFailed) and msg.error.status == 503
    assert "no executor" in msg.error.message


def test_routes_to_least_loaded_and_counts_what_it_sent() -> None:
    r = Router(max_queued=100)
    r.update_executors([beat("e1", running=3), beat("e2", running=1)])
    targets = [r.route(make_request(f"r{i}"))[0][0] for i in range(4)]
    # e2 is 2 lighter: it takes the first two, then they alternate.
    assert targets == ["rs:exec:e2", "rs:exec:e2", "rs:exec:e1", "rs:exec:e2"]


def test_queue_full_is_a_503() -> None:
    r = Router(max_queued=2)
    r.update_executors([beat("e1", waiting=1)])
    assert r.route(make_request("a"))[0][0] == "rs:exec:e1"
    _, msg = r.route(make_request("b"))[0]
    assert isinstance(msg, RequestFailed) and msg.error.status == 503
    assert "queue is full" in msg.error.message


def test_redelivered_request_is_sent_once() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")])
    assert len(r.route(make_request("a"))) == 1
    assert r.route(make_request("a")) == []


def test_abort_goes_to_the_executor_holding_the_request() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1"), beat("e2", running=5)])
    r.route(make_request("a"))
    assert r.abort(AbortRequest(rid="a")) == [("rs:exec:e1", AbortRequest(rid="a"))]


def test_abort_before_arrival_ends_the_request_when_it_arrives() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")])
    assert r.abort(AbortRequest(rid="early")) == []
    ((stream, msg),) = r.route(make_request("early"))
    # To its detokenizer, which ends it with finish reason "abort"; no executor sees it.
    assert stream == make_request("early").detok_stream
    assert msg == RequestAborted(rid="early")
    assert "early" not in r.assigned and "early" not in r.early_aborts


def test_lost_executor_fails_its_requests_only() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1"), beat("e2", running=1)])
    r.route(make_request("on-e1"))
    r.update_executors([beat("e1", ts=2.0), beat("e2", running=1, ts=2.0)])
    r.route(make_request("on-e2"))  # e1 has 1 sent since its beat; e2 has 1 running
    assert r.assigned["on-e2"].executor in ("e1", "e2")
    holder = r.assigned["on-e1"].executor
    out = r.update_executors(
        [b for b in (beat("e1", ts=3), beat("e2", ts=3)) if b.instance != holder]
    )
    failed = [m.rid for _, m in out if isinstance(m, RequestFailed)]
    assert "on-e1" in failed
    assert all(r.assigned[rid].executor != holder for rid in r.assigned)


def test_expired_request_is_refused() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")])
    _, msg = r.route(make_request("old", deadline=5.0), now=10.0)[0]
    assert isinstance(msg, RequestFailed) and msg.error.status == 504


def test_routing_stamps_the_requests_hop_times() -> None:
    router = Router(max_queued=10)
    router.update_executors([beat("e1")])
    hops = HopTimes(gateway_received=1.0, tokenized=2.0)
    req = make_request("a")
    timed = msgspec.structs.replace(req, trace=msgspec.structs.replace(req.trace, hops=hops))
    ((_, sent),) = router.route(timed, now=50.0)
    assert isinstance(sent, TokenizedRequest) and sent.trace.hops is not None
    assert sent.trace.hops.tokenized == 2.0 and sent.trace.hops.routed > 2.0
    assert msgspec.structs.replace(sent.trace.hops, routed=0.0) == hops
    # a request without HopTimes goes on unchanged
    assert router.route(make_request("b")) == [("rs:exec:e1", make_request("b"))]


def test_after_a_redis_restart_routes_are_forgotten_and_executors_get_a_grace() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")], now=0.0)
    r.route(make_request("old"))
    r.abort(AbortRequest(rid="early"))
    r.bus_restarted(grace_s=3.0, now=10.0)
    assert r.assigned == {} and r.early_aborts == {}
    # Every liveness key went with the old server: no heartbeat yet, but e1 is not lost.
    assert r.update_executors([], now=11.0) == []
    assert list(r.executors) == ["e1"]
    routed = r.route(make_request("new"))
    assert routed[0][0] == "rs:exec:e1"
    # Still silent after the grace: lost, and what it holds fails with a retryable 503.
    out = r.update_executors([], now=13.5)
    assert r.executors == {}
    ((stream, failed),) = out
    assert isinstance(failed, RequestFailed)
    assert (stream, failed.rid, failed.error.status) == ("rs:detok:0", "new", 503)
