"""Histogram bucket boundaries: SGLang's defaults for the four request latencies (so
dashboards built for SGLang read ours the same; the gateway's --bucket-* flags replace them),
and one set for the time of work inside a service."""

from __future__ import annotations

TIME_TO_FIRST_TOKEN = (
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 15.0, 20.0, 25.0, 30.0,
)  # fmt: skip
INTER_TOKEN_LATENCY = (
    0.002, 0.004, 0.006, 0.008, 0.01, 0.015, 0.02, 0.025, 0.03, 0.035, 0.04, 0.06,
    0.08, 0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0,
)  # fmt: skip
E2E_REQUEST_LATENCY = (
    0.1, 0.2, 0.4, 0.6, 0.8, 1.0, 2.0, 4.0, 6.0, 8.0, 10.0, 20.0, 40.0, 60.0,
    80.0, 100.0, 200.0, 400.0, 600.0, 1200.0, 1800.0, 2400.0,
)  # fmt: skip
TIME_PER_OUTPUT_TOKEN = (
    0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2,
    0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Work inside one service (a tokenization, a step, a compile, a hop): 100 us to 10 s.
SERVICE_SECONDS = (
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03,
    0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)  # fmt: skip
