"""`radixserve-loadtest lang` on the tiny model: every program of every workload finishes, the
cache serves most prompt tokens when on and none when off, and the report file says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from loadtest import lang_bench

pytestmark = [pytest.mark.slow]


def test_the_lang_benchmark_runs_each_workload_with_the_cache_on_and_off(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    out = tmp_path / "lang.json"
    # Two few-shot programs share their prefix as four do; with the cache off each of a
    # program's five requests prefills 1,900 tokens (four programs: 6.6 s of the test's 11)
    report = lang_bench.main(
        [
            "--model", str(tiny_model_dir), "--device", "cpu", "--max-total-tokens", "16384",
            "--few-shot-programs", "2", "--tot-programs", "1", "--multi-turn-programs", "2",
            "--tokens", "4", "--out", str(out),
        ]
    )  # fmt: skip
    assert json.loads(out.read_text()) == report
    runs = {(r["workload"], r["cache"]): r for r in report["runs"]}
    assert set(runs) == {(w, c) for w in ("few_shot", "tot", "multi_turn") for c in ("on", "off")}
    for (_, cache), run in runs.items():
        assert run["failed"] == 0 and run["programs"] > 0, run
        if cache == "off":
            assert run["cached_tokens"] == 0, run
        else:  # every program shares a long prefix with the others or its own earlier turns
            assert run["cache_hit_rate"] > 0.5, run
    # 1 prefix + 4 choices scored per few-shot program; 13 fork prefixes + 39 thoughts per tree
    assert runs[("few_shot", "on")]["requests"] == 2 * 5
    assert runs[("tot", "on")]["requests"] == 13 + 39
    assert runs[("multi_turn", "on")]["requests"] == 2 * 4
