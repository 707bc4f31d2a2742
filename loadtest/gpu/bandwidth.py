"""The copy bandwidth every roofline in the GPU sections is measured against."""

from __future__ import annotations

import torch


def copy_bandwidth(device: str = "cuda") -> float:
    """Bytes read + written per second by a device-to-device copy of 2 GiB on `device`; the
    buffers go back to the device on return (before a KV pool is sized)."""
    n = 2 * 2**30
    src = torch.empty(n, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    with torch.cuda.device(device):
        for _ in range(3):
            dst.copy_(src)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
    bw = 2 * n * 20 / (start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    return bw
