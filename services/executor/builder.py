"""Assembling an Engine: device and dtype, the model, a KV pool sized to the memory left."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

from services.executor import flags
from services.executor.attention import auto_backend
from services.executor.attention.flashinfer_backend import FLASHINFER_HEAD_DIMS
from services.executor.batch_policy import BatchPolicy
from services.executor.cache import NullCache, PrefixCache, RadixCache
from services.executor.cuda_device import make_current
from services.executor.cuda_graph import CudaGraphRunner
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.engine.loop import Engine
from services.executor.grammar.backend import GrammarBackend
from services.executor.kv_pool import ReqToTokenPool, kv_bytes_per_token, make_kv_pool
from services.executor.memory import KVManager
from services.executor.model_config import ModelConfig
from services.executor.model_runner import ModelRunner
from services.executor.models.gemv_plans import PlanStore
from services.executor.models.linear import choose_gemv
from services.executor.sampling.pooling import matryoshka_dimensions, model_pooling
from services.executor.sampling.step import Sampler
from services.executor.warmup import warm_up
from services.executor.weights import load_model
from shared.model_files import ModelSource

log = logging.getLogger(__name__)

CPU_DEFAULT_KV_TOKENS = 32768  # in the model dtype; an fp8 cache gets as many bytes
JUMP_EXTEND_MIN = 1.0  # forced tokens per running request that make an EXTEND step worth it
# --kv-cache-dtype -> the pool's dtype (None: the model's), as SGLang and vLLM name them.
KV_CACHE_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None,
    "fp8_e5m2": torch.float8_e5m2,
    "fp8_e4m3": torch.float8_e4m3fn,
}


# --gguf-weights -> load_model's gguf_blocks (None: blocks on CUDA only)
GGUF_WEIGHTS: dict[str, bool | None] = {"auto": None, "blocks": True, "dequantize": False}


@dataclass(frozen=True)
class EngineSettings:
    model: ModelSource
    name: str
    stream: str
    device: str = "auto"
    dtype: str = "auto"
    kv_cache_dtype: str = "auto"  # a key of KV_CACHE_DTYPES
    quantization: str = "auto"  # the checkpoint's weight format, or "fp8" (quant/registry.py)
    gguf_weights: str = "auto"  # a GGUF's Q8_0/Q4_K/Q6_K projections: auto | blocks | dequantize
    load_format: str = "auto"
    max_total_tokens: int = 0  # 0: automatic
    mem_fraction_static: float = flags.MEM_FRACTION_STATIC
    max_running_requests: int = flags.MAX_RUNNING_REQUESTS
    max_prefill_tokens: int = flags.MAX_PREFILL_TOKENS
    attention_backend: str = "auto"  # triton on CUDA, torch on the CPU
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int = flags.CUDA_GRAPH_MAX_BS
    seed: int = 0
    check_integrity: bool = False
    disable_radix_cache: bool = False
    page_size: int = 1
    schedule_policy: str = "lpm"
    sample_vocab: int = 0  # the tokenizer's vocabulary size; 0: the model's
    is_embedding: bool = False  # serve embeddings: every request is pooled, none generates
    embedding_pooling: str = "auto"  # last | mean | auto (what the checkpoint declares)


def settings_from_flags(
    a: argparse.Namespace, model: ModelSource, name: str, stream: str, sample_vocab: int
) -> EngineSettings:
    """The settings `radixserve executor`'s flags (services/executor/main.py) describe."""
    return EngineSettings(
        model=model,
        name=name,
        stream=stream,
        device=a.device,
        dtype=a.dtype,
        kv_cache_dtype=a.kv_cache_dtype,
        quantization=a.quantization,
        gguf_weights=a.gguf_weights,
        load_format=a.load_format,
        max_total_tokens=a.max_total_tokens,
        mem_fraction_static=a.mem_fraction_static,
        max_running_requests=a.max_running_requests,
        max_prefill_tokens=a.max_prefill_tokens,
        attention_backend=a.attention_backend,
        disable_cuda_graph=a.disable_cuda_graph,
        cuda_graph_max_bs=a.cuda_graph_max_bs,
        seed=a.seed,
        check_integrity=a.check_integrity,
        disable_radix_cache=a.disable_radix_cache,
        page_size=a.page_size,
        schedule_policy=a.schedule_policy,
        sample_vocab=sample_vocab,
        is_embedding=a.is_embedding,
        embedding_pooling=a.embedding_pooling,
    )


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


def check_flashinfer_model(config: ModelConfig) -> None:
    """--attention-backend flashinfer: refuse what its kernels cannot run (`auto` runs those
    models on Triton instead)."""
    if config.mla is not None:
        raise ValueError(
            f"--attention-backend flashinfer has no latent (MLA) attention for "
            f"{config.architecture}: use triton"
        )
    if config.head_dim not in FLASHINFER_HEAD_DIMS:
        raise ValueError(
            f"--attention-backend flashinfer runs head dims "
            f"{', '.join(map(str, FLASHINFER_HEAD_DIMS))}; {config.architecture}'s is "
            f"{config.head_dim}: use triton (auto does)"
        )


def pick_kv_dtype(
    name: str, model_dtype: torch.dtype, device: torch.device, backend: str
) -> torch.dtype:
    """The KV pool's dtype for --kv-cache-dtype; refuses what this device cannot run."""
    if name not in KV_CACHE_DTYPES:
        raise ValueError(
            f"--kv-cache-dtype={name!r}: unknown; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )
    kv_dtype = KV_CACHE_DTYPES[name] or model_dtype
    if backend == "flashinfer":
        if device.type != "cuda":
            raise ValueError("--attention-backend flashinfer runs on CUDA devices only")
        if kv_dtype != model_dtype:
            raise ValueError(
                f"--attention-backend flashinfer keeps the cache in the model's dtype; "
                f"--kv-cache-dtype={name} needs the triton backend"
            )
    if kv_dtype == torch.float8_e4m3fn and backend == "triton" and device.type == "cuda":
        # Triton has float8e4nv (e4m3fn) only from compute capability 8.9 (Ada, Hopper) on.
        major, minor = torch.cuda.get_device_capability(device)
        if (major, minor) < (8, 9):
            raise ValueError(
                f"--kv-cache-dtype=fp8_e4m3 needs a GPU of compute capability 8.9 or newer for "
                f"the Triton kernels; {torch.cuda.get_device_name(device)} is {major}.{minor}: "
                "use fp8_e5m2"
            )
    return kv_dtype


def kv_pool_tokens(
    s: EngineSettings,
    config: ModelConfig,
    dtype: torch.dtype,
    kv_dtype: torch.dtype,
    device: torch.device,
    kv_heads: int = 0,
) -> int:
    """--max-total-tokens, else the tokens the memory budget holds in the pool's dtype: on
    CUDA what --mem-fraction-static leaves, on the CPU what CPU_DEFAULT_KV_TOKENS take in
    the model's dtype (so an fp8 cache holds twice or four times as many)."""
    if s.max_total_tokens > 0:
        return s.max_total_tokens
    per_token = kv_bytes_per_token(config, kv_dtype, kv_heads)
    if device.type != "cuda":
        return CPU_DEFAULT_KV_TOKENS * kv_bytes_per_token(config, dtype) // per_token
    free, total = torch.cuda.mem_get_info(device)
    # Keep (1 - fraction) of the whole card for activations, graphs and the allocator.
    budget = free - total * (1 - s.mem_fraction_static)
    tokens = int(budget // per_token)
    if tokens < config.max_position_embeddings // 8:
        raise MemoryError(
            f"only {tokens} KV tokens fit in GPU memory; lower the model size or raise "
            "--mem-fraction-static"
        )
    return tokens


def _no_progress(phase: str, done: float) -> None:
    pass


@dataclass
class Built:
    """What every rank of an executor builds: the model and its pools, ready to run steps."""

    runner: ModelRunner
    config: ModelConfig
    policy: BatchPolicy
    device: torch.device


def build_runner(
    s: EngineSettings,
    progress: Callable[[str, float], None] = _no_progress,
    tp: TPGroup = SINGLE,
    device: torch.device | None = None,
) -> Built:
    """The model (this rank's shard of it), the KV pool sized to the memory left (the same
    number of slots on every rank) and the request table, CUDA graphs captured."""
    device = device or pick_device(s.device)
    make_current(device)
    dtype = pick_dtype(s.dtype, device)
    backend = s.attention_backend
    if backend == "auto":
        backend = auto_backend(device.type, KV_CACHE_DTYPES.get(s.kv_cache_dtype) is None)
    kv_dtype = pick_kv_dtype(s.kv_cache_dtype, dtype, device, backend)  # before the slow load
    model, config = load_model(
        s.model.path,
        device=device,
        dtype=dtype,
        load_format=s.load_format,
        attention_backend=backend,
        progress=lambda done: progress("weights", done),
        tp=tp,
        quantization=s.quantization,
        gguf_blocks=GGUF_WEIGHTS[s.gguf_weights],
    )
    model.eval()
    if backend == "flashinfer":
        check_flashinfer_model(config)
    progress("kv pool", 0.0)
    slots = tp.min_int(
        kv_pool_tokens(s, config, dtype, kv_dtype, device, model.num_kv_heads), device
    )
    kv = make_kv_pool(config, slots, kv_dtype, device, model.num_kv_heads)
    # No request holds more tokens than the pool (admission refuses prompt + max_new_tokens
    # past it): a 1M-token context on a 400K-slot pool needs no row of 1M int64 per request.
    context = min(config.max_position_embeddings, slots)
    rows = ReqToTokenPool(s.max_running_requests, context, device, pad_slot=kv.pad_slot)
    cache: PrefixCache = (
        NullCache(kv, s.page_size) if s.disable_radix_cache else RadixCache(kv, s.page_size)
    )
    graphed = device.type == "cuda" and not s.disable_cuda_graph
    policy = BatchPolicy(
        KVManager(kv, rows, cache),
        s.max_running_requests,
        s.max_prefill_tokens,
        s.schedule_policy,
        # Forced text extends once it averages a token per request, or at once where the
        # step runs as decode rows (policy.rows_limit, below): an eager EXTEND costs up to two
        # replayed decode steps. Without graphs both are eager: extend at once.
        jump_extend_min=JUMP_EXTEND_MIN if graphed else 0.0,
    )
    if device.type == "cuda" and dtype != torch.float32:
        progress("kernel timing", 0.0)  # a first start compiles every candidate here
        # before graphs capture the projections' kernels
        choose_gemv(model, dtype, PlanStore.for_device(device))
    graphs = None
    if graphed:
        if not hasattr(model.backend, "reserve_decode"):
            raise ValueError(
                f"attention backend {backend!r} cannot run in CUDA graphs; use triton or "
                "--disable-cuda-graph"
            )
        graphs = CudaGraphRunner(
            model, kv, rows, min(s.cuda_graph_max_bs, s.max_running_requests), device
        )
        progress("cuda graphs", 0.0)
        graphs.capture()
    runner = ModelRunner(model, kv, rows, config.vocab_size, device, graphs=graphs, tp=tp)
    policy.rows_limit = runner.rows_limit  # follows the runner: none once graphs are freed
    quant = model.quantization.name if model.quantization else str(dtype)
    log.info(
        "model %s (%s) on %s in %s%s; KV pool %d tokens in %s (%.1f MiB); attention %s",
        s.model.name,
        config.architecture,
        device,
        quant,
        f", rank {tp.rank} of {tp.size}" if tp.size > 1 else "",
        slots,
        kv_dtype,
        kv.nbytes() / 2**20,
        backend,
    )
    return Built(runner, config, policy, device)


def build_engine(
    s: EngineSettings,
    progress: Callable[[str, float], None] = _no_progress,
    grammars: GrammarBackend | None = None,
    tp: TPGroup = SINGLE,
    device: torch.device | None = None,
) -> Engine:
    """The engine for `s` (rank 0's, under tensor parallelism: the other ranks run
    distributed/follower.py); `progress(phase, share of it done)` hears how far loading is.
    `grammars`: how constrained requests get their matchers (None: they are refused)."""
    b = build_runner(s, progress, tp, device)
    sampler = Sampler(b.device, b.config.vocab_size, sample_vocab=s.sample_vocab, seed=s.seed)
    engine = Engine(
        s.name,
        s.stream,
        s.model.name,
        b.config.max_position_embeddings,
        b.policy,
        b.runner,
        sampler,
        grammars=grammars,
        check_integrity=s.check_integrity,
    )
    if b.device.type == "cuda":
        progress("warm-up", 0.0)
        warm_up(engine)  # with generation requests: embedding mode starts after it
    if s.is_embedding:
        pooling = model_pooling(s.model.directory, s.embedding_pooling)
        dims = matryoshka_dimensions(s.model.directory, b.config.hidden_size)
        engine.limits = dataclasses.replace(engine.limits, pooling=pooling, dimensions=dims)
        log.info("serving embeddings (pooling: %s)", pooling)
    return engine
