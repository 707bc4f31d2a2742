"""Reading a serve's per-child metrics: the port line it prints, and the deltas of CPU and
executor steps between two scrapes."""

from __future__ import annotations

from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from loadtest.stack_scrape import (
    STEP_METRIC,
    child_ports,
    sample,
    series_sample,
    series_table,
    summary,
    usage,
)


def test_child_ports_come_from_the_line_serve_prints() -> None:
    log = (
        "loading\nmetrics (/metrics, /health) on gateway-0 :9100, executor-0 :9101, "
        "executor-1 :9102\nready: ...\n"
    )
    assert child_ports(log) == {"gateway-0": 9100, "executor-0": 9101, "executor-1": 9102}
    assert child_ports("no metrics ports here") == {}


def _page(
    cpu: float, decode: list[float], extend: list[float], rows: list[float] | None = None
) -> str:
    reg = CollectorRegistry()
    Counter("process_cpu_seconds", "cpu", registry=reg).inc(cpu)
    h = Histogram(STEP_METRIC.replace(":", "_"), "steps", ["phase"], registry=reg)
    for phase, values in (("decode", decode), ("extend", extend), ("extend_rows", rows or [])):
        for v in values:
            h.labels(phase).observe(v)
    # prometheus_client cannot name a metric with ':'; the executor's collector does.
    return generate_latest(reg).decode().replace(STEP_METRIC.replace(":", "_"), STEP_METRIC)


def test_usage_is_the_difference_between_two_scrapes() -> None:
    before = {"executor-0": sample(_page(2.0, [0.01] * 10, [0.1])), "gateway-0": {"cpu_s": 1.0}}
    after = {
        "executor-0": sample(_page(6.0, [0.01] * 10 + [0.02] * 100, [0.1, 0.3], [0.004] * 4)),
        "gateway-0": {"cpu_s": 9.0},
    }
    report = usage(before, after, wall_s=8.0)
    ex = report["executor-0"]
    assert ex["cpu_share"] == 0.5
    assert ex["decode_steps"] == 100
    assert abs(ex["decode_step_ms"] - 20.0) < 1e-6
    assert abs(ex["decode_busy_share"] - 2.0 / 8.0) < 1e-6
    assert ex["extend_steps"] == 1 and abs(ex["extend_step_ms"] - 300.0) < 1e-6
    assert ex["extend_rows_steps"] == 4 and abs(ex["extend_rows_step_ms"] - 4.0) < 1e-6
    assert report["gateway-0"] == {"cpu_share": 1.0}


def test_the_summary_names_each_executor_and_the_busiest_cpu_first() -> None:
    services = {
        "executor-0": {
            "cpu_share": 1.2,
            "decode_steps": 10,
            "decode_step_ms": 29.5,
            "decode_busy_share": 0.7,
        },
        "gateway-0": {"cpu_share": 0.98},
        "detokenizer-0": {"cpu_share": 0.4},
    }
    line = summary(services)
    assert line.startswith("executor-0 decode 29.5 ms x 10 (busy 70%)")
    assert line.endswith("cpu (cores): executor-0 1.20, gateway-0 0.98, detokenizer-0 0.40")


def test_the_series_samples_each_executor_until_stopped() -> None:
    import http.server
    import threading

    from loadtest.stack_scrape import Series

    page = b"sglang:num_running_reqs 12.0\nsglang:num_queue_reqs 3.0\n"
    served = threading.Event()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.end_headers()
            self.wfile.write(page)
            served.set()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        port = server.server_address[1]
        series = Series({"executor-0": port, "gateway-0": port}, period_s=0.01)
        series.start()
        assert served.wait(10)
        while len(series.samples) < 2:
            served.clear()
            assert served.wait(10)
        samples = series.stop()
    finally:
        server.shutdown()
    assert all(set(s) == {"t", "client", "executor-0", "gateway-0"} for s in samples)
    assert samples[0]["executor-0"] == {"running": 12.0, "queued": 3.0}
    assert samples[-1]["t"] >= samples[0]["t"]
    assert samples[-1]["client"]["cpu_s"] >= samples[0]["client"]["cpu_s"] > 0


def _series_page(cpu: float, running: int, generated: int, busy: float, backlog: int) -> str:
    lines = [
        f"process_cpu_seconds_total {cpu}",
        f"sglang:num_running_reqs {running}",
        "sglang:num_queue_reqs 0",
        f"radixserve:executor_generated_tokens_total {generated}",
        f'{STEP_METRIC}_sum{{phase="decode"}} {busy}',
        f'{STEP_METRIC}_sum{{phase="extend"}} 0.5',
        f'radixserve:stream_pending{{stream="replies"}} {backlog}',
        'radixserve:stream_pending{stream="aborts"} 0',
    ]
    return "\n".join(lines) + "\n"


def _gateway_page(cpu: float, backlog: int) -> str:
    return f'process_cpu_seconds_total {cpu}\nradixserve:stream_pending{{stream="out"}} {backlog}\n'


def test_a_series_sample_reads_cpu_backlog_tokens_and_busy_time() -> None:
    got = series_sample(_series_page(3.0, 7, 1000, 2.5, 40))
    assert got == {
        "cpu_s": 3.0,
        "running": 7.0,
        "queued": 0.0,
        "generated": 1000.0,
        "busy_s": 3.0,  # decode and extend together
        "pending": {"replies": 40.0},  # empty streams left out
    }


def test_the_series_table_gives_rates_per_interval() -> None:
    def row(t: float, cpu: float, gen: int, busy: float, backlog: int) -> dict[str, Any]:
        return {
            "t": t,
            "client": {"cpu_s": cpu / 2},
            "executor-0": series_sample(_series_page(cpu, 5, gen, busy, 0)),
            "gateway-0": series_sample(_gateway_page(cpu, backlog)),
        }

    samples = [row(0.0, 1.0, 0, 0.0, 0), row(1.0, 1.5, 50, 0.5, 3), row(2.0, 2.0, 500, 1.5, 9)]
    (line,) = series_table(samples, every_s=2.0)
    assert line.startswith("t=   2.0")
    assert "client cpu 0.25" in line
    assert "executor-0 run 5 q 0 busy 0.75 250 tok/s" in line
    assert "gateway-0 cpu 0.50 backlog 9" in line
