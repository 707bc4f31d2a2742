"""The executor's flags, which `radixserve serve` takes too: importable without torch, so
that parsing the launcher's arguments costs no torch, transformers or xgrammar import (about
3 s of CPU at every `radixserve serve`)."""

from __future__ import annotations

from services.executor.quant.registry import QUANTIZATION_CHOICES
from shared.config import EnvArgumentParser, positive

# --kv-cache-dtype's names (builder.KV_CACHE_DTYPES maps them to torch dtypes)
KV_CACHE_DTYPE_NAMES = ("auto", "fp8_e5m2", "fp8_e4m3")
# Defaults of the flags below that builder.EngineSettings and loadtest/offline.py repeat
MEM_FRACTION_STATIC = 0.85
MAX_RUNNING_REQUESTS = 512
MAX_PREFILL_TOKENS = 8192
CUDA_GRAPH_MAX_BS = 512


def add_flags(p: EnvArgumentParser) -> None:
    """The executor's own flags (`radixserve serve` takes them too)."""
    p.add_flag("--device", default="auto", help="cpu, cuda, cuda:N, or auto (cuda if present)")
    p.add_flag(
        "--dtype",
        default="auto",
        choices=["auto", "float32", "bfloat16", "float16"],
        help="weights and KV dtype (auto: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_flag(
        "--kv-cache-dtype",
        default="auto",
        choices=list(KV_CACHE_DTYPE_NAMES),
        help="KV cache dtype: auto (the model's) or fp8_e5m2 / fp8_e4m3, 8-bit floats with "
        "scale 1.0: twice the tokens per byte and half the attention reads, less precision",
    )
    p.add_flag(
        "--quantization",
        default="auto",
        choices=list(QUANTIZATION_CHOICES),
        help="weight format: auto (the checkpoint's quantization_config: fp8 per tensor, per "
        "channel or 128x128 blocks; others are refused) or fp8 (a float checkpoint quantized "
        "per channel at load: half the weight bytes)",
    )
    p.add_flag(
        "--gguf-weights",
        default="auto",
        choices=["auto", "blocks", "dequantize"],
        help="a GGUF file's Q8_0/Q4_K/Q6_K projections: blocks (kept as the file's blocks, "
        "dequantised on the fly by the kernels: fewer bytes a token), dequantize (to --dtype "
        "at load, as other types are), or auto (blocks on CUDA, dequantize on the CPU)",
    )
    p.add_flag(
        "--load-format",
        default="auto",
        choices=["auto", "dummy"],
        help="dummy: random weights at the model's shapes (benchmarks)",
    )
    p.add_flag(
        "--max-total-tokens",
        type=int,
        default=0,
        help="KV pool size in tokens (0: 32768 on CPU, from --mem-fraction-static on CUDA)",
    )
    p.add_flag(
        "--mem-fraction-static",
        type=float,
        default=MEM_FRACTION_STATIC,
        check=lambda v: None if 0 < v < 1 else "must be in (0, 1)",
        help="share of GPU memory for weights and the KV pool",
    )
    p.add_flag(
        "--max-running-requests",
        type=int,
        default=MAX_RUNNING_REQUESTS,
        check=positive,
        help="requests decoding at once",
    )
    p.add_flag(
        "--max-prefill-tokens",
        type=int,
        default=MAX_PREFILL_TOKENS,
        check=positive,
        help="prompt tokens computed per step (longer prompts are chunked)",
    )
    p.add_flag(
        "--attention-backend",
        default="auto",
        choices=["auto", "torch", "triton", "flashinfer"],
        help="attention kernels: triton (CUDA), flashinfer (CUDA; pip install "
        "'radixserve[flashinfer]') or the torch reference (auto: triton on CUDA)",
    )
    p.add_bool("--disable-cuda-graph", help="launch decode kernels one by one (debugging)")
    p.add_flag(
        "--cuda-graph-max-bs",
        type=int,
        default=CUDA_GRAPH_MAX_BS,
        check=positive,
        help="largest decode batch replayed from a CUDA graph",
    )
    p.add_flag("--seed", type=int, default=0, help="sampling seed of this executor")
    p.add_bool(
        "--disable-jump-forward",
        help="decode text a grammar forces one token per step instead of appending it at once",
    )
    p.add_bool("--disable-radix-cache", help="compute every prompt from scratch (no prefix reuse)")
    p.add_flag(
        "--page-size",
        type=int,
        default=1,
        check=positive,
        help="tokens per page of the prefix cache (only whole pages are reused)",
    )
    p.add_flag(
        "--schedule-policy",
        default="lpm",
        choices=["lpm", "fcfs"],
        help="admission order: longest cached prefix first, or arrival order",
    )
    p.add_bool(
        "--check-integrity",
        help="verify the KV pool accounting after every step and stop loudly if it breaks "
        "(tests and debugging)",
    )
    add_parallel_flags(p)


def add_parallel_flags(p: EnvArgumentParser) -> None:
    """Tensor parallelism: one executor over several GPUs (SGLang's flag names)."""
    p.add_flag(
        "--tp-size",
        type=int,
        default=1,
        check=positive,
        help="ranks (GPUs) one executor's model is split over; the others are started by it",
    )
    p.add_flag(
        "--nnodes", type=int, default=1, check=positive, help="hosts the --tp-size ranks span"
    )
    p.add_flag(
        "--node-rank",
        type=int,
        default=0,
        help="this host's place among --nnodes (0 serves the bus; the others only compute)",
    )
    p.add_flag(
        "--dist-init-addr",
        default="",
        help="host:port where node 0's rank 0 gathers the group (default on one node: a free "
        "local port)",
    )
    p.add_flag(
        "--base-gpu-id",
        type=int,
        default=0,
        help="the GPU of this node's first rank; its others take the GPUs after it",
    )
