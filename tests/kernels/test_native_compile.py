"""Every kernel of kernels/ compiles for an sm_90 GPU, checked on a machine without one
(tests/kernels/native_compile.py): the interpreter the other kernel tests run in never compiles,
so without this a kernel the compiler rejects would pass CI and fail on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

from tests.kernels.native_compile import kernel_names
from tests.kernels.native_compile_cases import CASES

ROOT = Path(__file__).resolve().parents[2]


def _why_not() -> str | None:
    if torch.cuda.is_available():
        return "a CUDA device is here: the kernel tests compile every kernel natively"
    from triton.backends import backends

    if "nvidia" not in backends:
        return f"this Triton build has no NVIDIA backend to compile with ({', '.join(backends)})"
    return None


pytestmark = pytest.mark.skipif(_why_not() is not None, reason=_why_not() or "")


def _compile(args: list[str], cache: Path) -> subprocess.CompletedProcess[str]:
    """A process of its own without TRITON_INTERPRET (this one has it, set by conftest.py and
    decided at import), on a fresh Triton cache."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(cache)
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240
    )


@pytest.mark.skipif(
    os.environ.get("RADIXSERVE_NATIVE_COMPILE_BESIDE") == "1",
    reason="scripts/check.sh runs this compile itself, beside the tests, at low priority",
)
def test_every_kernel_compiles_for_sm90(tmp_path: Path) -> None:
    proc = _compile(["-m", "tests.kernels.native_compile"], tmp_path)
    lines = proc.stdout.splitlines()
    failures = [line for line in lines if not line.startswith("ok ")]
    assert proc.returncode == 0, "\n".join([*failures, proc.stderr[-3000:]])
    assert sum(line.startswith("ok ") for line in lines) == len(CASES)


@triton.jit
def _mismatched_kernel(out_ptr, n):
    """One name, two shapes: the interpreter runs it, the compiler refuses to merge them."""
    if n > 1:  # noqa: SIM108 (the if/else statement is what the compiler refuses)
        x = tl.zeros([16, 4], dtype=tl.float32)
    else:
        x = tl.zeros([4], dtype=tl.float32)
    tl.store(out_ptr + tl.arange(0, 4)[None, :], x)


def launch_mismatched() -> None:
    """The bad kernel, launched as a launcher would (n = 3, not 1, which Triton would make a
    constant and the `if` static)."""
    _mismatched_kernel[(1,)](torch.empty(4), 3)


@triton.jit
def _pipelined_dot_kernel(
    a_ptr, b_ptr, c_ptr, K, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr
):
    """A K loop of tl.dot: the compiler stages its A and B tiles in shared memory."""
    offs_m, offs_n, offs_k = tl.arange(0, BM), tl.arange(0, BN), tl.arange(0, BK)
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    for k in range(0, K, BK):
        a = tl.load(a_ptr + offs_m[:, None] * K + (k + offs_k)[None, :])
        b = tl.load(b_ptr + (k + offs_k)[:, None] * BN + offs_n[None, :])
        acc = tl.dot(a, b, acc)
    tl.store(c_ptr + offs_m[:, None] * BN + offs_n[None, :], acc)


def launch_oversized_tiles() -> None:
    """64 x 64 x 256 bf16 tiles in 4 stages: 256 KiB of shared memory, which compiles and
    which an H100 (227 KiB a block) refuses to load. (128 x 128 x 256 tiles, 512 KiB, took
    4.3 s to compile against 1.6.)"""
    a, b = torch.empty(64, 4096, dtype=torch.bfloat16), torch.empty(4096, 64).bfloat16()
    _pipelined_dot_kernel[(1,)](a, b, torch.empty(64, 64), 4096, 64, 64, 256, num_stages=4)


_BAD_CASES = """
import sys
from tests.kernels import native_compile as nc
from tests.kernels import test_native_compile as t
nc.install()
results = [
    nc.run_case(nc.Case("bad/mismatched-if", t.launch_mismatched)),
    nc.run_case(nc.Case("bad/oversized-tiles", t.launch_oversized_tiles)),
]
print("\\n".join(map(nc.report, results)))
sys.exit(sum(r.error is not None for r in results))
"""


def test_what_the_gpu_would_refuse_is_reported_as_failed(tmp_path: Path) -> None:
    proc = _compile(["-c", _BAD_CASES], tmp_path)
    assert proc.returncode == 2, proc.stdout + proc.stderr[-3000:]
    mismatched, oversized = proc.stdout.split("\nFAIL ")
    assert mismatched.startswith("FAIL") and "bad/mismatched-if (_mismatched_kernel)" in mismatched
    assert "CompilationError" in mismatched and "Mismatched type for x" in mismatched
    assert "bad/oversized-tiles (_pipelined_dot_kernel)" in oversized
    assert "OutOfResources: out of resource: shared memory" in oversized


def test_every_launched_kernel_needs_a_case() -> None:
    """The coverage check's list: the launched kernels, not the helpers they call."""
    names = kernel_names()
    assert {
        "kernels.mla_prep._mla_prep_kernel",
        "kernels.decode_attention._decode_stage2_kernel",
        "kernels.moe_align._scatter_kernel",
    } <= names
    assert not any(n.endswith(("pdl_prologue", "_rotated_halves", "store_rows")) for n in names)
