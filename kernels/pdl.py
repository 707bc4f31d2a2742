"""Programmatic dependent launch (PDL) for the kernels of a decode step.

A decode step of a small batch is hundreds of short kernels (a 30B MoE model: about 600 at
batch 1), each doing a few microseconds of work, and between two of them the GPU drains the
first and only then launches the second. With PDL (Hopper and newer), a kernel launched with
the attribute may start while the kernel before it is still running: its programs are placed
on the SMs and wait at `griddepcontrol.wait` until the previous kernel has completed and its
writes are visible. The launch latency and the ramp-up of each kernel overlap the tail of the
one before.

Every kernel that opts in calls `pdl_prologue(PDL)` first, before it reads or writes any
memory, so ordering is exactly as without PDL: nothing is touched before the previous kernel is
done, and since every kernel of the chain waits for its predecessor before completing, a kernel
also sees everything before that. Right after the wait it lets the next kernel launch.

Launchers pass `**pdl_launch(device)`: the kernel's PDL constexpr, and Triton's `launch_pdl`
where the device supports it. Off on the CPU interpreter, on GPUs before compute capability 9,
and with RADIXSERVE_PDL=0 (to compare, or to rule it out). Inside a captured CUDA graph the
launch attribute becomes a programmatic edge between the two kernel nodes.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

from kernels._checks import interpreting

try:  # Triton 3.4 and newer
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - older Triton: PDL is never switched on
    gdc_launch_dependents = gdc_wait = None


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    """Wait for the previous kernel in the stream, then let the next one launch."""
    if PDL:
        gdc_wait()
        gdc_launch_dependents()


@functools.cache
def _device_supports(index: int) -> bool:
    return torch.cuda.get_device_capability(index)[0] >= 9


def pdl_enabled(device: torch.device) -> bool:
    """Whether kernels on `device` launch with PDL."""
    if device.type != "cuda" or interpreting() or gdc_wait is None:
        return False
    if os.environ.get("RADIXSERVE_PDL", "1") == "0":
        return False
    return _device_supports(device.index if device.index is not None else 0)


def pdl_launch(device: torch.device) -> dict[str, Any]:
    """A launch's PDL keyword arguments: {"PDL": ...} for the kernel, and Triton's
    launch_pdl where it is on."""
    if pdl_enabled(device):
        return {"PDL": True, "launch_pdl": True}
    return {"PDL": False}
