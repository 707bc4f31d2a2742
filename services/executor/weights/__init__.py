"""`load_model`: a checkpoint path in, a ready model and its config out.

Accepts a HF directory (config.json + *.safetensors, sharded or not, or pytorch_model*.bin),
a .gguf file (or a directory holding exactly one), and `load_format="dummy"` for random
weights at the checkpoint's shapes.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Callable

import torch

from services.executor.attention import get_backend
from services.executor.distributed.group import SINGLE, TPGroup
from services.executor.errors import ModelLoadError
from services.executor.model_config import ModelConfig
from services.executor.models.llama import LlamaForCausalLM
from services.executor.quant.base import QuantConfig
from services.executor.quant.gguf_config import from_gguf as gguf_from_file
from services.executor.quant.registry import resolve as resolve_quantization
from services.executor.weights.gguf import iter_gguf_weights, open_gguf
from services.executor.weights.hf import hf_weight_files, iter_hf_weights
from services.executor.weights.loader import (
    block_weights,
    build_empty_model,
    finish_loading,
    init_dummy_weights,
    load_weights,
)
from shared.model_files import forget_gguf

__all__ = ["load_model"]


def load_model(
    path: str | os.PathLike[str],
    device: torch.device | str = "cpu",
    dtype: torch.dtype | None = None,
    load_format: str = "auto",
    attention_backend: str = "torch",
    progress: Callable[[float], None] | None = None,
    tp: TPGroup = SINGLE,
    quantization: str = "auto",
    gguf_blocks: bool | None = None,
) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Build the model for `path` on `device` in `dtype` (None: the checkpoint's own dtype);
    under tensor parallelism (`tp`), this rank's shard of it.

    load_format: "auto" reads the weights; "dummy" fills them with N(0, 0.02) (norms = 1) and
    needs only the config. Raises ModelLoadError (missing/corrupt files, weights that don't
    match the config) or UnsupportedModelError (architecture, rope type, quantisation).
    `progress` hears the share of the weights loaded. quantization: --quantization ("auto":
    the checkpoint's own format, from its quantization_config; "fp8": fp8 weights, quantized
    at load from a float checkpoint); an unsupported format raises
    UnsupportedQuantizationError before any weight is read. gguf_blocks: a GGUF file's
    Q8_0/Q4_K/Q6_K projections stay in their blocks (quant/gguf_config.py) rather than being
    dequantised at load; None: on CUDA only (the CPU would dequantise them at every call).
    """
    if load_format not in ("auto", "dummy"):
        raise ValueError(f"unknown load_format {load_format!r}; known: auto, dummy")
    path = os.fspath(path)
    gguf_path = _gguf_file(path)
    if gguf_path is not None:
        reader = open_gguf(gguf_path)
        config = ModelConfig.from_gguf(reader)
        source = gguf_path
    else:
        config = ModelConfig.from_hf_dir(path)
        source = path
    quant = resolve_quantization(quantization, config.quantization)
    if gguf_blocks is None:
        gguf_blocks = torch.device(device).type == "cuda"
    if gguf_path is not None and quant is None and gguf_blocks:
        quant = gguf_from_file(reader, config)
    if quant is not None:
        quant.check_device(torch.device(device))
    model = build_empty_model(
        config,
        torch.device(device),
        dtype or _dtype_named(config.torch_dtype, quant),
        get_backend(attention_backend),
        tp,
        quant,
    )
    if load_format == "dummy":
        init_dummy_weights(model)
    elif gguf_path is not None:
        blocks = block_weights(model)
        load_weights(model, iter_gguf_weights(reader, config, blocks), source, progress)
        forget_gguf()
    else:
        load_weights(model, iter_hf_weights(hf_weight_files(path)), source, progress)
    finish_loading(model)
    return model, config


def _gguf_file(path: str) -> str | None:
    """The GGUF file `path` names, None for a HF directory; ModelLoadError for anything else."""
    if os.path.isfile(path):
        with open(path, "rb") as f:
            if f.read(4) != b"GGUF":
                raise ModelLoadError(f"{path} is neither a GGUF file nor a model directory")
        return path
    if not os.path.isdir(path):
        raise ModelLoadError(f"model path does not exist: {path}")
    if os.path.exists(os.path.join(path, "config.json")):
        return None
    ggufs = glob.glob(os.path.join(path, "*.gguf"))
    if len(ggufs) == 1:
        return ggufs[0]
    raise ModelLoadError(
        f"{path} has no config.json and {len(ggufs)} .gguf files; cannot tell what to load"
    )


def _dtype_named(name: str, quant: QuantConfig | None) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise ModelLoadError(f"config names an unknown torch dtype {name!r}")
    if quant is not None and dtype.itemsize == 1:  # fp8 checkpoints may say float8 here
        return torch.bfloat16
    return dtype
