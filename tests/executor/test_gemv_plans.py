"""The gemv choices kept between starts: saved, read back, merged between processes, a damaged
or unwritable file costing only a timing, and choose_gemv timing only the shapes it has no
saved choice for (on the CPU, with the timing replaced by a recording stand-in)."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import torch

import services.executor.models.linear as linear
from services.executor.models import gemv_plans
from services.executor.models.gemv_plans import PlanStore
from services.executor.models.linear import CANDIDATES, GemvConfig, Linear, choose_gemv

A, B = CANDIDATES[0], GemvConfig(4, 1024, 2, 3, packed=True)


def test_choices_read_back_in_another_store(tmp_path: Path) -> None:
    path = tmp_path / "gemv" / "h200.json"
    store = PlanStore(path)
    assert store.get("64x32 unquantized") is None
    store.put("64x32 unquantized", {1: A, 3: B}, 12.5)
    store.put("128x64 fp8", {}, 0.0)  # the dense product won every row count
    store.save()
    again = PlanStore(path)
    assert again.get("64x32 unquantized") == ({1: A, 3: B}, 12.5)
    assert again.get("128x64 fp8") == ({}, 0.0)


def test_two_processes_choices_merge(tmp_path: Path) -> None:
    path = tmp_path / "h200.json"
    first, second = PlanStore(path), PlanStore(path)
    first.put("a", {1: A}, 1.0)
    second.put("b", {2: B}, 2.0)
    first.save()
    second.save()  # read before first saved: merges, not overwrites
    merged = PlanStore(path)
    assert merged.get("a") == ({1: A}, 1.0) and merged.get("b") == ({2: B}, 2.0)


def test_a_damaged_file_is_timed_again_and_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "h200.json"
    path.write_text('{"a": {"rows": {"1": {"block_n": 8}}')  # cut short
    with caplog.at_level(logging.WARNING):
        store = PlanStore(path)
    assert store.get("a") is None and "timing again" in caplog.text
    store.put("a", {1: A}, 1.0)
    store.save()
    assert PlanStore(path).get("a") == ({1: A}, 1.0)


def test_an_unwritable_directory_only_logs(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")  # a file where the directory would be
    store = PlanStore(blocker / "gemv" / "h200.json")
    store.put("a", {1: A}, 1.0)
    with caplog.at_level(logging.WARNING):
        store.save()
    assert "not saved" in caplog.text


def test_the_file_name_follows_the_gpu_the_pdl_switch_and_the_code(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    kernel = tmp_path / "kernels" / "k.py"
    kernel.parent.mkdir()
    kernel.write_text("x = 1\n")
    monkeypatch.setattr(gemv_plans, "ROOT", tmp_path)
    monkeypatch.setattr(gemv_plans, "CODE", ("kernels",))
    monkeypatch.delenv("RADIXSERVE_PDL", raising=False)
    name = gemv_plans.file_name("NVIDIA H200", (9, 0))
    assert name == gemv_plans.file_name("NVIDIA H200", (9, 0))
    assert name != gemv_plans.file_name("NVIDIA H100 80GB HBM3", (9, 0))
    monkeypatch.setenv("RADIXSERVE_PDL", "0")
    assert name != gemv_plans.file_name("NVIDIA H200", (9, 0))
    monkeypatch.delenv("RADIXSERVE_PDL")
    kernel.write_text("x = 2\n")
    assert name != gemv_plans.file_name("NVIDIA H200", (9, 0))


def test_the_cache_directory_follows_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RADIXSERVE_CACHE_DIR", str(tmp_path / "c"))
    assert gemv_plans.cache_dir() == tmp_path / "c" / "gemv"
    monkeypatch.delenv("RADIXSERVE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gemv_plans.cache_dir() == tmp_path / "xdg" / "radixserve" / "gemv"


def test_choose_gemv_times_only_what_no_start_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    timed: list[tuple[int, int]] = []
    compiled: list[int] = []

    def fake_plan(layer: Linear, dtype: torch.dtype) -> tuple[dict[int, GemvConfig], float]:
        timed.append(tuple(layer.weight.shape))  # type: ignore[arg-type]
        return ({1: A} if layer.out_features == 64 else {2: B}), float(layer.out_features)

    def fake_compile(calls: list[Any], device: torch.device) -> int:
        compiled.append(len(calls))
        return 0

    monkeypatch.setattr(linear, "_on_gpu", lambda layer: True)
    monkeypatch.setattr(linear, "_plan", fake_plan)
    monkeypatch.setattr(linear, "compile_ahead", fake_compile)
    path = tmp_path / "h200.json"

    def model() -> torch.nn.Sequential:  # two layers of one shape, one of another
        return torch.nn.Sequential(Linear(32, 64), Linear(32, 64), Linear(64, 16))

    first = model()
    saved = choose_gemv(first, torch.float16, PlanStore(path))
    assert sorted(timed) == [(16, 64), (64, 32)] and len(compiled) == 1
    assert saved == {"64x32": 64.0, "16x64": 16.0}
    assert [m.gemv_plan for m in first] == [{1: A}, {1: A}, {2: B}]

    timed.clear()
    compiled.clear()
    second = model()
    assert choose_gemv(second, torch.float16, PlanStore(path)) == saved
    assert timed == [] and compiled == []  # nothing timed or compiled
    assert [m.gemv_plan for m in second] == [{1: A}, {1: A}, {2: B}]

    # other activations are another timing; without a store every start times
    choose_gemv(model(), torch.bfloat16, PlanStore(path))
    assert len(timed) == 2
    choose_gemv(model(), torch.float16)
    assert len(timed) == 4


def test_a_failed_write_leaves_no_temporary_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(gemv_plans.json, "dump", full)
    store = PlanStore(tmp_path / "h200.json")
    store.put("a", {1: A}, 1.0)
    with caplog.at_level(logging.WARNING):
        store.save()
    assert "No space left" in caplog.text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["h200.lock"]
