"""The device-timeline summary of the GPU benchmark, on a hand-made trace."""

from __future__ import annotations

from loadtest.gpu.timeline import device_intervals, summarize


def test_busy_time_merges_overlaps_and_gaps_name_their_neighbours() -> None:
    trace = {
        "traceEvents": [
            {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 100},
            {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 50, "dur": 100},
            {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "ts": 0, "dur": 1000},  # host
            {"ph": "X", "cat": "kernel", "name": "argmax", "ts": 160, "dur": 40},  # 10 µs gap
            {"ph": "X", "cat": "kernel", "name": "bitmask", "ts": 400, "dur": 100},  # 200 µs
            {"ph": "i", "cat": "kernel", "name": "marker", "ts": 450},
        ]
    }
    intervals = device_intervals(trace)
    assert [name for _, _, name in intervals] == ["gemm", "Memcpy HtoD", "argmax", "bitmask"]
    s = summarize(intervals, steps=2)
    # busy: [0, 150] + [160, 200] + [400, 500] = 290 µs of a 500 µs window, over 2 steps
    assert abs(s["busy_ms_per_step"] - 0.145) < 1e-9
    assert abs(s["window_ms_per_step"] - 0.25) < 1e-9
    assert abs(s["busy_share"] - 0.58) < 1e-9
    # Only the 200 µs stretch is long enough to report, between argmax and bitmask.
    assert s["longest_gaps_us"] == [(200.0, "argmax", "bitmask")]
    assert s["gaps_per_step"] == 0.5
    assert s["top_kernels_us_per_step"][0] == (50.0, "gemm")


def test_an_empty_trace_says_so() -> None:
    assert "error" in summarize([], steps=4)


def test_gc_pauses_counts_collections_inside_the_block() -> None:
    import gc

    from loadtest.gpu.timeline import GcPauses

    with GcPauses() as pauses:
        gc.collect()
    report = pauses.report()
    assert report["gen2"]["count"] >= 1 and report["gen2"]["max_ms"] > 0
    gc.collect()  # outside the block: not counted
    assert pauses.report() == report
