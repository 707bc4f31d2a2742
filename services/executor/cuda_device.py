"""The GPU a thread launches on.

CUDA's current device belongs to each host thread, and a new thread starts on GPU 0. Triton
launches its kernels on the current device whatever its arguments' device is, so an engine
built for GPU N and stepped from another thread (the executor's step pool, the Python
`Engine`'s thread) would launch on GPU 0 with pointers it cannot reach. Every thread that
builds or steps an engine makes its GPU current first, once.
"""

from __future__ import annotations

import threading

import torch

_bound = threading.local()


def make_current(device: torch.device) -> None:
    """Make `device` this thread's current CUDA device (a no-op on the CPU, and after the
    first call on a thread)."""
    if device.type != "cuda" or device.index is None:  # "cuda" names the current one
        return
    if getattr(_bound, "device", None) == device:
        return
    torch.cuda.set_device(device)
    _bound.device = device
