"""Assembling an Engine: device and dtype, the model, a KV pool sized to the memory left."""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from services.executor.batch_policy import BatchPolicy
from services.executor.cache import NullCache, PrefixCache, RadixCache
from services.executor.cuda_graph import CudaGraphRunner
from services.executor.engine import Engine
from services.executor.kv_pool import KVPool, ReqToTokenPool
from services.executor.memory import KVManager
from services.executor.model_config import ModelConfig
from services.executor.model_runner import ModelRunner
from services.executor.models.linear import choose_gemv
from services.executor.warmup import warm_up
from services.executor.weights import load_model
from shared.model_files import ModelSource

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 32768


@dataclass(frozen=True)
class EngineSettings:
    model: ModelSource
    name: str
    stream: str
    device: str = "auto"
    dtype: str = "auto"
    load_format: str = "auto"
    max_total_tokens: int = 0  # 0: automatic
    mem_fraction_static: float = 0.85
    max_running_requests: int = 256
    max_prefill_tokens: int = 8192
    attention_backend: str = "auto"  # triton on CUDA, torch on the CPU
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = 256
    seed: int = 0
    check_integrity: bool = False
    disable_radix_cache: bool = False
    page_size: int = 1
    schedule_policy: str = "lpm"
    sample_vocab: int = 0  # the tokenizer's vocabulary size; 0: the model's


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device={name}: CUDA is not available on this machine")
    return dev


def pick_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[name]


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    elem = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * config.num_kv_heads * config.head_dim * elem


def kv_pool_tokens(
    s: EngineSettings, config: ModelConfig, dtype: torch.dtype, device: torch.device
) -> int:
    if s.max_total_tokens > 0:
        return s.max_total_tokens
    if device.type != "cuda":
        return CPU_DEFAULT_KV_TOKENS
    free, total = torch.cuda.mem_get_info(device)
    # Keep (1 - fraction) of the whole card for activations, graphs and the allocator.
    budget = free - total * (1 - s.mem_fraction_static)
    tokens = int(budget // kv_bytes_per_token(config, dtype))
    if tokens < config.max_position_embeddings // 8:
        raise MemoryError(
            f"only {tokens} KV tokens fit in GPU memory; lower the model size or raise "
            "--mem-fraction-static"
        )
    return tokens


def build_engine(s: EngineSettings) -> Engine:
    device = pick_device(s.device)
    dtype = pick_dtype(s.dtype, device)
    backend = s.attention_backend
    if backend == "auto":
        backend = "triton" if device.type == "cuda" else "torch"
    model, config = load_model(
        s.model.path,
        device=device,
        dtype=dtype,
        load_format=s.load_format,
        attention_backend=backend,
    )
    model.eval()
    slots = kv_pool_tokens(s, config, dtype, device)
    kv = KVPool(slots, config.num_layers, config.num_kv_heads, config.head_dim, dtype, device)
    context = config.max_position_embeddings
    rows = ReqToTokenPool(s.max_running_requests, context, device, pad_slot=kv.pad_slot)
    cache: PrefixCache = (
        NullCache(kv, s.page_size) if s.disable_radix_cache else RadixCache(kv, s.page_size)
    )
    policy = BatchPolicy(
        KVManager(kv, rows, cache),
        s.max_running_requests,
        s.max_prefill_tokens,
        s.schedule_policy,
    )
    if device.type == "cuda" and dtype != torch.float32:
        choose_gemv(model)  # before graphs capture the projections' kernels
    graphs = None
    if device.type == "cuda" and not s.disable_cuda_graph:
        if not hasattr(model.backend, "reserve_decode"):
            raise ValueError(
                f"attention backend {backend!r} cannot run in CUDA graphs; use triton or "
                "--disable-cuda-graph"
            )
        graphs = CudaGraphRunner(
            model, kv, rows, min(s.cuda_graph_max_bs, s.max_running_requests), device
        )
        graphs.capture()
    runner = ModelRunner(
        model,
        kv,
        rows,
        config.vocab_size,
        device,
        seed=s.seed,
        graphs=graphs,
        sample_vocab=s.sample_vocab,
    )
    log.info(
        "model %s (%s) on %s in %s; KV pool %d tokens (%.1f MiB)",
        s.model.name,
        config.architecture,
        device,
        dtype,
        slots,
        slots * kv_bytes_per_token(config, dtype) / 2**20,
    )
    engine = Engine(
        s.name, s.stream, s.model.name, context, policy, runner, check_integrity=s.check_integrity
    )
    if device.type == "cuda":
        warm_up(engine)
    return engine
