"""Argument checks shared by the kernel launchers, so every launcher fails the same clear way.

A Triton kernel given a tensor of the wrong shape or layout reads the wrong memory silently;
the launchers check everything they can without a host sync (never tensor values).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence

import torch

from kernels.fp8_kv import FP8_KV_DTYPES
from kernels.fp8_weights import BLOCK as FP8_BLOCK

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# What a KV pool may hold: the model's float dtypes, or fp8 (kernels/fp8_kv.py).
KV_DTYPES = (*FLOAT_DTYPES, *FP8_KV_DTYPES)
INDEX_DTYPES = (torch.int32, torch.int64)


def next_pow2(n: int) -> int:
    """The least power of two at least n (0 for n <= 0), as triton.next_power_of_2 gives it:
    plain Python, where Triton's is a constexpr function costing about 2 µs a call on the host,
    paid by every eager launch that sizes a block with it."""
    return 1 << (n - 1).bit_length() if n > 0 else 0


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device; 0 elsewhere (the interpreter)."""
    if device.type != "cuda":
        return 0
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


# Rows a program by default in the interpreter, for launchers whose GPU default is a row or a
# few: it runs programs one after another, each at a cost that hardly depends on its size, so
# fewer, wider ones (a model's tests on the CPU; the GGUF model test's expansions took 175 s
# at one row a program, 12 s at 64)
INTERPRETER_BLOCK_N = 64


def check_tensor(
    op: str,
    name: str,
    t: torch.Tensor,
    *,
    shape: Sequence[int | None],
    dims: str,
    dtypes: Sequence[torch.dtype],
    device: torch.device | None = None,
    last_contiguous: bool = True,
) -> None:
    """Raise ValueError/TypeError unless `t` has `shape` (None: any size) and one of `dtypes`.

    dims names the dimensions for the message, e.g. "[num_tokens, num_heads, head_dim]".
    last_contiguous: the last dimension must have stride 1 (other strides are passed on).
    """
    # Called for every tensor of every launch (about a thousand per prefill of a large
    # model): the passing path is kept to plain comparisons, messages only on failure.
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    got = t.shape
    if len(got) != len(shape):
        _bad_shape(op, name, got, shape, dims)
    for g, want in zip(got, shape):  # noqa: B905 (lengths are equal)
        if want is not None and g != want:
            _bad_shape(op, name, got, shape, dims)
    if t.dtype not in dtypes:
        names = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{op}: {name} must be one of {names}, got {t.dtype}")
    if last_contiguous and got and got[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(
            f"{op}: {name} must be contiguous in its last dimension, got strides {t.stride()}"
        )
    if device is not None and t.device != device:
        raise ValueError(f"{op}: {name} is on {t.device}, expected {device}")


def _bad_shape(op: str, name: str, got: torch.Size, shape: Sequence[int | None], dims: str) -> None:
    want_str = "(" + ", ".join("*" if s is None else str(s) for s in shape) + ")"
    raise ValueError(f"{op}: {name} must have shape {dims} = {want_str}, got {tuple(got)}")


def check_fp8_scale(
    op: str, scale: torch.Tensor, n: int, k: int, block_scales: bool, device: torch.device
) -> None:
    """An fp8 weight [n, k]'s fp32 scales (kernels/fp8_weights.py): [n, 1], one per row, or
    with block_scales [ceil(n/128), ceil(k/128)], one per 128x128 block."""
    if block_scales:
        shape, dims = (-(-n // FP8_BLOCK), -(-k // FP8_BLOCK)), "[ceil(n/128), ceil(k/128)]"
    else:
        shape, dims = (n, 1), "[n, 1]"
    check_tensor(
        op, "scale", scale, shape=shape, dims=dims, dtypes=(torch.float32,), device=device,
        last_contiguous=block_scales,
    )  # fmt: skip


def check_device(op: str, t: torch.Tensor) -> None:
    """Triton runs CUDA tensors natively and CPU tensors only in the interpreter."""
    if t.device.type == "cpu" and not interpreting():
        raise ValueError(
            f"{op}: tensors are on the CPU; Triton kernels need a CUDA device "
            "(or TRITON_INTERPRET=1 for the CPU interpreter)"
        )


def check_tile(op: str, name: str, size: int) -> None:
    """A tile dimension fed to tl.dot: a power of two, at least 16."""
    if size < 16 or size & (size - 1):
        raise ValueError(f"{op}: {name} must be a power of two >= 16, got {size}")


def check_launch(op: str, num_warps: int, num_stages: int) -> None:
    """A launch configuration Triton accepts."""
    if not 1 <= num_stages <= 8 or num_warps not in (1, 2, 4, 8, 16):
        raise ValueError(
            f"{op}: num_stages must be 1 to 8 and num_warps a power of two up to 16, "
            f"got {num_stages} and {num_warps}"
        )


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot input precision: exact fp32 products for fp32 inputs (the default, tf32, keeps
    only 10 mantissa bits); 16-bit inputs are exact either way."""
    return "ieee" if dtype == torch.float32 else "tf32"


def check_attention_inputs(
    op: str,
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    req_to_token: torch.Tensor,
    q_dims: str,
) -> tuple[int, int, int]:
    """Queries [*, heads, d] and one layer's K/V pool read through req_to_token, as both
    attention kernels take them. Returns (num_heads, head_dim, num_kv_heads)."""
    check_tensor(op, "q", q, shape=(None, None, None), dims=q_dims, dtypes=FLOAT_DTYPES)
    check_device(op, q)
    _, num_heads, head_dim = q.shape
    kv_dims = "[slots, kv_heads, d]"
    check_tensor(
        op,
        "k_buffer",
        k_buffer,
        shape=(None, None, head_dim),
        dims=kv_dims,
        dtypes=KV_DTYPES,
        device=q.device,
    )
    num_kv_heads = k_buffer.shape[1]
    check_tensor(
        op,
        "v_buffer",
        v_buffer,
        shape=k_buffer.shape,
        dims=kv_dims,
        dtypes=(k_buffer.dtype,),
        device=q.device,
    )
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(
            f"{op}: num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    check_tensor(
        op,
        "req_to_token",
        req_to_token,
        shape=(None, None),
        dims="[max_reqs, max_context]",
        dtypes=INDEX_DTYPES,
        device=q.device,
    )
    return num_heads, head_dim, num_kv_heads


def check_window_softcap(op: str, window: int | None, softcap: float | None) -> None:
    """A sliding window is a positive number of keys; a softcap a positive float."""
    if window is not None and (not isinstance(window, int) or window < 1):
        raise ValueError(f"{op}: window must be a positive int or None, got {window!r}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"{op}: softcap must be positive or None, got {softcap!r}")
