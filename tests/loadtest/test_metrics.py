"""Metric formulas on synthetic timings with known answers."""

from __future__ import annotations

import pytest

from loadtest.backends import RequestResult, Usage
from loadtest.metrics import Distribution, cache_hit_rate, compute, throughput_timeline


def make_result(
    start: float,
    chunk_times: list[float],
    end: float,
    usage: Usage | None = None,
    text: str = "",
    prompt_len: int = 0,
) -> RequestResult:
    return RequestResult(True, start, end, prompt_len, list(chunk_times), text, usage)


def failed(error: str) -> RequestResult:
    return RequestResult(False, 0.0, 0.1, 0, error=error)


def never_called(text: str) -> int:
    raise AssertionError("usage was reported: nothing to re-tokenize")


# A: sent at 0, chunks at 0.10 0.15 0.25 0.30, done at 0.32; 4 tokens, 10 prompt, 5 cached.
# B: sent at 1, chunks at 1.20 1.40, done at 1.40; 2 tokens, 30 prompt, 0 cached.
A = make_result(0.0, [0.10, 0.15, 0.25, 0.30], 0.32, Usage(10, 4, 5))
B = make_result(1.0, [1.20, 1.40], 1.40, Usage(30, 2, 0))


def test_latencies_of_known_streams() -> None:
    m = compute([A, B], duration_s=2.0, count_tokens=never_called)
    assert m.ttft is not None and m.itl is not None and m.tpot is not None and m.e2e is not None
    assert m.ttft.mean == pytest.approx((100 + 200) / 2)
    # gaps: A 50 100 50, B 200 -> mean 100, median 75
    assert m.itl.mean == pytest.approx(100.0)
    assert m.itl.median == pytest.approx(75.0)
    # TPOT: A (320 - 100) / 3, B (400 - 200) / 1
    assert m.tpot.mean == pytest.approx((220 / 3 + 200) / 2)
    assert m.e2e.mean == pytest.approx((320 + 400) / 2)
    assert m.e2e.std == pytest.approx(40.0)


def test_throughputs_and_token_totals() -> None:
    m = compute([A, B, failed("HTTP 400: nope")], duration_s=2.0, count_tokens=never_called)
    assert (m.completed, m.failed) == (2, 1)
    assert (m.total_input_tokens, m.total_output_tokens) == (40, 6)
    assert m.request_throughput == pytest.approx(1.0)
    assert m.input_throughput == pytest.approx(20.0)
    assert m.output_throughput == pytest.approx(3.0)
    assert m.total_throughput == pytest.approx(23.0)
    assert m.concurrency == pytest.approx((0.32 + 0.40) / 2.0)
    assert m.token_counts == "server usage"
    assert m.errors == ["HTTP 400: nope"]


def test_percentiles_interpolate_linearly() -> None:
    d = Distribution.of([i / 1000 for i in range(1, 101)])  # 1..100 ms
    assert d is not None
    assert (d.median, d.p90, d.p95, d.p99) == pytest.approx((50.5, 90.1, 95.05, 99.01))
    assert Distribution.of([]) is None


def test_cache_hit_rate_counts_only_requests_that_report_it() -> None:
    no_details = make_result(0.0, [0.1], 0.2, Usage(1000, 1, None))
    assert cache_hit_rate([A, B, no_details]) == pytest.approx(5 / 40)
    assert cache_hit_rate([no_details]) is None
    assert cache_hit_rate([make_result(0.0, [0.1], 0.2)]) is None  # no usage at all


def test_without_usage_tokens_are_counted_by_the_client() -> None:
    r = make_result(0.0, [0.1, 0.2, 0.3], 0.3, text="a b c d e f", prompt_len=12)
    m = compute([r, A], duration_s=1.0, count_tokens=lambda text: len(text.split()))
    assert m.total_output_tokens == 6 + 4
    assert m.total_input_tokens == 12 + 10
    assert m.token_counts == "server usage (1 of 2 by client tokenizer)"
    assert m.tpot is not None
    assert m.tpot.mean == pytest.approx(((0.3 - 0.1) / 5 + 0.22 / 3) / 2 * 1000)
    assert m.cache_hit_rate == pytest.approx(5 / 10)


def test_single_token_outputs_have_no_tpot_and_no_text_means_ttft_is_e2e() -> None:
    one = make_result(0.0, [0.1], 0.1, Usage(5, 1, 0))
    empty = make_result(0.0, [], 0.4, Usage(5, 0, 0))
    m = compute([one, empty], duration_s=1.0, count_tokens=never_called)
    assert m.tpot is None and m.itl is None
    assert m.ttft is not None and m.ttft.mean == pytest.approx((100 + 400) / 2)


def test_json_keys_follow_sglang() -> None:
    out = compute([A, B], duration_s=2.0, count_tokens=never_called).to_json()
    for key in ("mean_ttft_ms", "median_itl_ms", "p99_tpot_ms", "mean_e2e_latency_ms"):
        assert key in out
    assert out["output_throughput"] == pytest.approx(3.0)


def test_throughput_timeline_spreads_tokens_over_chunks() -> None:
    times, tokens, done = throughput_timeline([A, B], started=0.0, count_tokens=never_called)
    assert times == [0.0, 1.0]
    assert tokens == pytest.approx([4.0, 2.0])
    assert done == pytest.approx([1.0, 1.0])


def test_hop_medians_per_stage_in_the_servers_order() -> None:
    results = [make_result(0.0, [0.1], 1.0) for _ in range(3)]
    results[0].hops = {"tokenize": 1.0, "queue": 10.0, "total": 30.0}
    results[1].hops = {"tokenize": 3.0, "queue": 20.0, "total": 50.0}
    results[2].hops = None  # a request that reported none is left out
    m = compute(results, 1.0, lambda s: 1)
    assert m.hop_median_ms == {"tokenize": 2.0, "queue": 15.0, "total": 40.0}
    assert compute(results[2:], 1.0, lambda s: 1).hop_median_ms is None
