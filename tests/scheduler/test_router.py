"""Routing, the bounded queue, aborts and executor loss, without Redis."""

from __future__ import annotations

import msgspec

from services.scheduler import failover, routes
from services.scheduler.router import Router
from shared import constants
from shared.messages.common import AbortRequest, HopTimes
from shared.messages.detok import RequestAborted, RequestFailed, Reroute
from shared.messages.schedule import TokenizedRequest
from tests.scheduler.factories import beat, make_request


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


def test_a_lost_executor_hands_over_its_requests_only() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1"), beat("e2", running=1)], now=0.0)
    r.route(make_request("on-e1"))
    r.update_executors([beat("e1", ts=2.0), beat("e2", running=1, ts=2.0)], now=0.5)
    r.route(make_request("on-e2"))  # e1 has 1 sent since its beat; e2 has 1 running
    holder = r.assigned["on-e1"].executor
    lost = r.update_executors(
        [b for b in (beat("e1", ts=3), beat("e2", ts=3)) if b.instance != holder], now=1.0
    )
    assert [ex.instance for ex in lost] == [holder]
    assert "on-e1" in lost[0].requests and not lost[0].maybe_alive  # its key is gone
    assert lost[0].stream == f"rs:exec:{holder}"
    assert all(a.executor != holder for a in r.assigned.values())
    assert holder not in r.executors


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
    # Still silent after the grace: lost, with what it holds.
    lost = r.update_executors([], now=13.5)
    assert r.executors == {}
    assert [(ex.instance, list(ex.requests)) for ex in lost] == [("e1", ["new"])]


def test_an_executor_whose_heartbeat_stalls_is_lost_within_the_stale_window() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1", ts=1.0), beat("e2", ts=1.0)], now=0.0)
    r.route(make_request("a"))
    holder = r.assigned["a"].executor
    other = "e2" if holder == "e1" else "e1"
    # The holder's key is still there but its beat stops changing; the other beats on.
    for t in (0.5, 1.0, 1.5, 2.0):
        assert r.update_executors([beat(holder, ts=1.0), beat(other, ts=1.0 + t)], now=t) == []
    lost = r.update_executors([beat(holder, ts=1.0), beat(other, ts=9.0)], now=2.1)
    assert [ex.instance for ex in lost] == [holder]
    assert lost[0].maybe_alive and list(lost[0].requests) == ["a"]
    assert list(r.executors) == [other]
    # New requests go to the live one only; the silent one is live again once it beats anew.
    assert r.route(make_request("b"))[0][0] == f"rs:exec:{other}"
    assert r.update_executors([beat(holder, ts=1.0), beat(other, ts=9.5)], now=2.5) == []
    assert holder not in r.executors
    r.update_executors([beat(holder, ts=3.0), beat(other, ts=10.0)], now=3.0)
    assert set(r.executors) == {holder, other}


def test_routes_are_stored_until_done_and_restored_by_a_new_leader() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")], now=0.0)
    req = make_request("a")
    r.route(req)
    saves, deletes = r.take_changes()
    assert deletes == [] and list(saves) == ["a"]
    record = routes.decode(saves["a"])
    assert record is not None and record.executor == "e1"
    stored = msgspec.msgpack.decode(record.request, type=TokenizedRequest)
    assert stored.input_ids == req.input_ids and stored.trace.rid == "a"
    # A new leader rebuilds the table; its executor died meanwhile: the request is handed over.
    fresh = Router(max_queued=10)
    fresh.restore("a", record)
    lost = fresh.update_executors([], now=0.0)
    assert [(ex.instance, list(ex.requests)) for ex in lost] == [("e1", ["a"])]
    # A request the detokenizer finished is forgotten, here and in Redis.
    r.done("a")
    assert "a" not in r.assigned and r.take_changes() == ({}, ["a"])


def test_failover_resumes_each_request_through_its_detokenizer() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1", ts=1.0)], now=0.0)
    r.route(make_request("a"))
    saves, _ = r.take_changes()
    records = {rid: rec for rid, raw in saves.items() if (rec := routes.decode(raw)) is not None}
    lost = r.update_executors([beat("e1", ts=1.0)], now=5.0)  # stalled, key still there
    out = failover.reroutes(lost, records)
    assert out == [
        ("rs:detok:0", Reroute(rid="a", executor="e1", request=records["a"].request)),
        ("rs:exec:e1", AbortRequest(rid="a", reason="rerouted")),  # in case it lives on
    ]
    assert failover.streams_to_drop(lost) == ["rs:exec:e1"]
    # No stored route: a retryable 503 instead.
    ((_, msg),) = [m for m in failover.reroutes(lost, {}) if m[0] == "rs:detok:0"]
    assert isinstance(msg, RequestFailed) and msg.error.retry_after == 1


def test_a_resumed_request_avoids_the_executor_it_was_lost_from_and_skips_the_queue() -> None:
    r = Router(max_queued=1)
    r.update_executors([beat("e1", waiting=5), beat("e2", waiting=5)])
    resumed = msgspec.structs.replace(make_request("a"), resumes=1, avoid=["e1"])
    assert r.route(resumed)[0][0] == "rs:exec:e2"  # the queue is full, but it is admitted
    _, refused = r.route(make_request("b"))[0]
    assert isinstance(refused, RequestFailed) and "queue is full" in refused.error.message


def test_a_resumed_request_with_nowhere_to_go_waits_for_an_executor() -> None:
    """Only the executor it was lost from is alive (or none): it waits (the supervisor's
    restart brings a new one), and fails with a retryable 503 only past --resume-wait."""
    resumed = msgspec.structs.replace(make_request("a"), resumes=1, avoid=["e1"])
    r = Router(max_queued=10, resume_wait_s=30.0)
    r.update_executors([beat("e1")], now=0.0)
    assert r.route(resumed, now=100.0) == [] and "a" in r.parked
    assert r.unpark(now=110.0) == []  # still nowhere to go
    r.update_executors([beat("e1"), beat("e2")], now=1.0)  # e1's replacement is up
    assert r.unpark(now=115.0)[0][0] == "rs:exec:e2"
    assert r.assigned["a"].executor == "e2" and not r.parked
    late = Router(max_queued=10, resume_wait_s=30.0)
    assert late.route(resumed, now=100.0) == []  # no executor at all: it waits too
    assert late.unpark(now=129.0) == []
    ((stream, msg),) = late.unpark(now=130.0)
    assert stream == "rs:detok:0" and isinstance(msg, RequestFailed) and msg.error.status == 503
    assert msg.error.retry_after == 1 and "no executor came back" in msg.error.message


def test_the_requests_of_a_gateway_that_is_gone_are_aborted() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")])
    assert r.update_gateways(["g1", "g2"]) == []
    for rid, gateway in (("a", "g1"), ("b", "g2")):
        req = make_request(rid)
        trace = msgspec.structs.replace(req.trace, reply_to=constants.reply_stream(gateway))
        r.route(msgspec.structs.replace(req, trace=trace))
    assert r.update_gateways(["g2"]) == [
        ("rs:exec:e1", AbortRequest(rid="a", reason="gateway lost"))
    ]
    assert r.update_gateways(["g2"]) == []  # once
    # After a Redis restart every key is gone for a moment: nothing is aborted for that.
    r.bus_restarted(grace_s=3.0, now=100.0)
    req = make_request("c")
    trace = msgspec.structs.replace(req.trace, reply_to=constants.reply_stream("g2"))
    r.route(msgspec.structs.replace(req, trace=trace))
    assert r.update_gateways([], now=101.0) == []
    # Still gone after the grace: it is.
    assert r.update_gateways([], now=104.0) == [
        ("rs:exec:e1", AbortRequest(rid="c", reason="gateway lost"))
    ]


def test_a_batch_whose_commit_failed_is_routed_again_when_it_comes_again() -> None:
    """The routes of a batch whose commit (messages, stored routes, acks) failed were never
    sent: the redelivered entries are routed again, not dropped as already sent."""
    r = Router(max_queued=10)
    r.update_executors([beat("e1")])
    r.abort(AbortRequest(rid="early"))
    assert r.route(make_request("a"))[0][0] == "rs:exec:e1"
    assert isinstance(r.route(make_request("early"))[0][1], RequestAborted)
    r.done("old")
    r.take_changes()
    r.commit_failed()
    assert "a" not in r.assigned and "early" in r.early_aborts
    assert r.route(make_request("a"))[0][0] == "rs:exec:e1"  # again, not "already sent"
    assert isinstance(r.route(make_request("early"))[0][1], RequestAborted)
    saves, deletes = r.take_changes()
    assert list(saves) == ["a"] and deletes == ["old"]  # the deletion is retried too
    r.committed()
    assert r.route(make_request("a")) == []  # committed: a redelivery is a duplicate


def test_lost_requests_whose_resumption_failed_are_lost_again_next_time() -> None:
    r = Router(max_queued=10)
    r.update_executors([beat("e1")], now=0.0)
    r.route(make_request("a"))
    lost = r.update_executors([], now=1.0)
    assert "a" not in r.assigned
    r.unlose(lost)
    again = r.update_executors([], now=1.5)
    assert [(ex.instance, list(ex.requests)) for ex in again] == [("e1", ["a"])]
