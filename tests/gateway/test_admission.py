"""Admission decisions without Redis or HTTP: caps on requests in flight and queued tokens."""

from __future__ import annotations

from services.gateway.admission import Admission


def test_admits_up_to_the_inflight_cap_then_refuses_with_retry_after() -> None:
    a = Admission(max_inflight=4, max_queued_tokens=0)
    assert a.check(inflight=3, new=1) is None
    refused = a.check(inflight=3, new=2)  # one call of two samples would pass the cap
    assert refused is not None
    assert refused.status == 503 and refused.type == "service_unavailable"
    assert "limit 4" in refused.message
    assert refused.headers() == {"Retry-After": "1"}
    assert a.refused == 1


def test_queued_tokens_cap_follows_the_executors_reports() -> None:
    a = Admission(max_inflight=100, max_queued_tokens=1000)
    a.observe([400, 599])
    assert a.check(inflight=0, new=1) is None
    a.observe([400, 600])
    refused = a.check(inflight=0, new=1)
    assert refused is not None and refused.status == 503
    assert "1000 prompt tokens" in refused.message and "limit 1000" in refused.message
    assert refused.headers() == {"Retry-After": "1"}
    a.observe([])  # the backlog drained: admitted again
    assert a.check(inflight=0, new=1) is None


def test_zero_means_no_token_limit() -> None:
    a = Admission(max_inflight=10, max_queued_tokens=0)
    a.observe([10**9])
    assert a.check(inflight=0, new=1) is None
