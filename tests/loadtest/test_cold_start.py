"""The start-time benchmark: phases read from the progress lines as they arrived, and a whole
run on the CPU (a cold and a warm start of the tiny model, each a process of its own)."""

from __future__ import annotations

import json
from pathlib import Path

from loadtest import cold_start


def test_each_phase_lasts_until_the_next_one_starts() -> None:
    lines = [
        (10.5, "some log line"),
        (11.0, "loading tiny [------] 5% weights"),
        (12.0, "loading tiny [##----] 50% weights"),
        (14.0, "loading tiny [####--] 85% kv pool"),
        (14.5, "a warning in between"),
        (15.0, "loading tiny [#####-] 86% kernel timing"),
        (25.0, "loading tiny [######] 97% warm-up"),
    ]
    assert cold_start.phases(lines, started=10.0, ready=26.0) == {
        "before": 1.0,
        "weights": 3.0,
        "kv pool": 1.0,
        "kernel timing": 10.0,
        "warm-up": 1.0,
    }
    assert cold_start.phases([], started=10.0, ready=12.5) == {"before": 2.5}


def test_a_cold_and_a_warm_start_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "cold.json"
    result = cold_start.main(["--kinds", "bf16", "--device", "cpu", "--out", str(out)])
    assert result is not None and json.loads(out.read_text()) == result
    starts = result["starts"]["bf16"]
    for start in ("cold", "warm"):
        row = starts[start]
        assert row["ready_s"] >= row["before"] > 0
        assert {"weights", "kv pool"} <= set(row)
        assert row["text"]
    assert starts["cold"]["text"] == starts["warm"]["text"]  # greedy, the same weights
