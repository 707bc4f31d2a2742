"""compile_ahead runs launches side by side in threads, as its caller would run them, and the
start-up timing of the projections hands it every launch it then times."""

from __future__ import annotations

import threading
from functools import partial
from pathlib import Path
from typing import Any

import pytest
import torch

from kernels.compile_ahead import compile_ahead
from kernels.gemv import MAX_M
from services.executor.models.linear import CANDIDATES, Linear, Unquantized, _launches
from services.executor.quant.base import LinearMethod
from tests.kernels.test_native_compile import _compile, _why_not


def test_calls_run_side_by_side_in_inference_mode() -> None:
    # Two calls that each wait for the other: run one after another, the barrier breaks.
    barrier = threading.Barrier(2, timeout=60)
    seen: list[tuple[str, bool]] = []

    def call() -> None:
        barrier.wait()
        seen.append((threading.current_thread().name, torch.is_inference_mode_enabled()))

    assert compile_ahead([call, call], torch.device("cpu"), threads=2) == 0
    assert len({name for name, _ in seen}) == 2
    assert all(inference for _, inference in seen)


def test_a_call_that_raises_is_counted_not_raised() -> None:
    ran: list[int] = []

    def bad() -> None:
        raise RuntimeError("out of resource: shared memory")

    assert compile_ahead([bad, lambda: ran.append(1), bad], torch.device("cpu")) == 2
    assert ran == [1]
    assert compile_ahead([], torch.device("cpu")) == 0


class Recorder:
    """dense and gemv record (rows, configuration or None for dense, dtype)."""

    made: list[tuple[int, object, torch.dtype]]

    def dense(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        self.made.append((x.shape[0], None, x.dtype))
        return x

    def gemv(self, layer: Any, x: torch.Tensor, cfg: Any) -> torch.Tensor:
        self.made.append((x.shape[0], cfg, x.dtype))
        return x


class RecordingUnquantized(Recorder, Unquantized):
    name = "recording-unquantized"


class RecordingFormat(Recorder, LinearMethod):
    name = "recording-format"
    AHEAD = (8, 24)

    def dense_ahead_rows(self, layer: Any) -> tuple[int, ...]:
        return self.AHEAD


@pytest.mark.parametrize("method", [RecordingUnquantized, RecordingFormat])
def test_every_timed_launch_is_compiled_ahead(method: type[Recorder]) -> None:
    """_launches covers what _plan times: each candidate at each row count, and the dense
    product only where it is not cuBLAS (a quantized format's), there also at the decode
    batches' row counts the format's kernels specialise by."""
    layer = Linear(64, 32)
    recorder = method()
    recorder.made = []
    layer.method = recorder  # type: ignore[assignment]
    for call in _launches(layer, torch.float16):
        call()
    rows = range(1, MAX_M + 1)
    want: set[tuple[int, object, torch.dtype]] = {
        (m, cfg, torch.float16) for m in rows for cfg in CANDIDATES
    }
    if method is RecordingFormat:
        want |= {(m, None, torch.float16) for m in [*rows, *RecordingFormat.AHEAD]}
    assert len(recorder.made) == len(want)
    assert set(recorder.made) == want


# Eight gemv launches of two kernel specialisations (block_k 128 or 256), in four threads:
# the first four start together, all on one specialisation.
_DEDUPE = """
import torch
import tests.kernels.native_compile as nc
from triton import knobs
from kernels.compile_ahead import compile_ahead
from kernels.gemv import gemv

nc.install()
compiled = []
knobs.runtime.jit_post_compile_hook = lambda **kw: compiled.append(kw["key"])
x, w = torch.randn(1, 256, dtype=torch.bfloat16), torch.randn(32, 256, dtype=torch.bfloat16)
calls = [lambda b=b: gemv(x, w, block_k=b) for b in [128] * 4 + [256] * 4]
assert compile_ahead(calls, torch.device("cpu"), threads=4) == 0
print(len(compiled), len(set(compiled)))
"""


@pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")
def test_each_specialisation_compiles_once(tmp_path: Path) -> None:
    """Compiled for sm_90 without a GPU (tests/kernels/native_compile.py), in a process of its
    own: threads that reach a specialisation another thread compiles skip it, so two are
    compiled for eight launches, not one per thread that starts on it."""
    proc = _compile(["-c", _DEDUPE], tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["2", "2"]


@pytest.mark.gpu
def test_launches_compiled_ahead_are_not_compiled_again() -> None:
    """On the GPU, the threads' compiles land in the cache the caller's own launches read:
    each configuration compiles once, in compile_ahead, and the same launches after it add
    nothing (with a device set wrongly per thread they would compile again)."""
    from kernels.gemv import _gemv_kernel, gemv, gemv_ref

    device = torch.device("cuda", torch.cuda.current_device())
    x = torch.randn(3, 384, dtype=torch.float16, device=device)
    w = torch.randn(200, 384, dtype=torch.float16, device=device)
    # launch configurations no other test uses, so none is compiled before this test
    configs = [(2, 128, 2, 5), (4, 128, 2, 6), (8, 128, 1, 5), (2, 256, 1, 6)]

    def compiled() -> int:
        return sum(len(caches[0]) for caches in _gemv_kernel.device_caches.values())

    def launch(cfg: tuple[int, int, int, int]) -> torch.Tensor:
        block_n, block_k, warps, stages = cfg
        return gemv(x, w, block_n=block_n, block_k=block_k, num_warps=warps, num_stages=stages)

    before = compiled()
    assert compile_ahead([partial(launch, c) for c in configs], device, threads=4) == 0
    assert compiled() == before + len(configs)
    for cfg in configs:
        torch.testing.assert_close(launch(cfg), gemv_ref(x, w), atol=2e-3, rtol=2e-3)
    assert compiled() == before + len(configs)
