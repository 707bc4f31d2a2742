"""gpu_bench section quant_decode: batch-1 decode (in 128, out 256) at Llama-3.1-8B's shapes
with dummy weights in each weight format, in tok/s and as a share of that format's own
roofline: the bytes a decode step actually reads (every parameter but the embedding table,
of which one row; the KV cache at the run's mean context) over the copy bandwidth measured
in the same run.

Formats are a table (`FORMATS`): a name, the offline benchmark's flags, and what
config.json's quantization_config says; adding a format is one line. GGUF Q4_K runs from
config.json too (quant_method "gguf", quant/gguf_config.py): random valid blocks at the
model's shapes, read as blocks by the same kernels a .gguf file's are. int4 (AWQ, GPTQ)
weights count what the w4a16 kernels read: the packed words, fp16 scales and uint8 zero
points of each group of 128 (the parameters after load, so the roofline is the format's
own). Each section loads a few 8B models, bf16 first for the ratio (`SECTIONS`): all of
them would not fit one section's time.
"""

from __future__ import annotations

import gc
import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import torch

from loadtest import offline
from loadtest.gpu.bandwidth import copy_bandwidth
from loadtest.gpu.models import llama8b_dir
from services.executor.kv_pool import kv_bytes_per_token
from services.executor.models.llama import LlamaForCausalLM
from services.executor.quant.fp8_checkpoint import quantization_config

IN_LEN, OUT_LEN = 128, 256


class WeightFormat(NamedTuple):
    flags: tuple[str, ...]  # offline flags (--quantization fp8: quantized at load)
    quantization_config: dict[str, Any] | None  # written into config.json


FORMATS: dict[str, WeightFormat] = {
    "bf16": WeightFormat((), None),
    "fp8_channel": WeightFormat(("--quantization", "fp8"), None),
    "fp8_block": WeightFormat((), quantization_config("block")),
    # every projection Q4_K blocks (a Q4_K_M file keeps some in Q6_K); embedding and LM head bf16
    "gguf_q4_k": WeightFormat((), {"quant_method": "gguf", "weight_type": "Q4_K"}),
    "int4_awq": WeightFormat(
        (),
        {
            "quant_method": "awq",
            "bits": 4,
            "group_size": 128,
            "zero_point": True,
            "version": "gemm",
        },
    ),
    "int4_gptq": WeightFormat(
        (),
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False, "sym": True},
    ),
}
# gpu_bench section -> the formats it runs
SECTIONS: dict[str, tuple[str, ...]] = {
    "quant_decode": ("bf16", "fp8_channel", "fp8_block", "gguf_q4_k"),
    "quant_decode_int4": ("bf16", "int4_awq", "int4_gptq"),
}


def quant_decode_section(formats: tuple[str, ...] = SECTIONS["quant_decode"]) -> dict[str, Any]:
    bandwidth = copy_bandwidth()
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bandwidth / 1e12,
    }
    for name in formats:
        out[name] = decode_one(name, FORMATS[name], bandwidth)
    base = out.get("bf16", {}).get("decode_tok_s")
    for name in formats:
        if base:
            out[name]["vs_bf16"] = out[name]["decode_tok_s"] / base
    return out


def decode_one(name: str, fmt: WeightFormat, bandwidth: float) -> dict[str, Any]:
    model = llama8b_dir(Path(tempfile.mkdtemp()))
    if fmt.quantization_config is not None:
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"] = fmt.quantization_config
        (model / "config.json").write_text(json.dumps(config))
    args = offline.parse_args(
        [
            *("latency", "--model", str(model), "--load-format", "dummy"),
            *("--batch-size", "1", "--input-len", str(IN_LEN), "--output-len", str(OUT_LEN)),
            *("--max-total-tokens", "8192"),  # three models in one process: small pools
            *fmt.flags,
        ]
    )
    engine = offline.make_engine(args)
    result = offline.run_latency(engine, args)
    # the mean context of the decode steps
    step_bytes = bytes_per_step(engine.runner.model, engine.policy.kv.dtype, IN_LEN + OUT_LEN // 2)
    roofline = bandwidth / step_bytes
    result.update(
        format=name,
        bytes_per_step=step_bytes,
        roofline_tok_s=roofline,
        share_of_roofline=result["decode_tok_s"] / roofline,
    )
    del engine
    gc.collect()  # the next format's engine needs this one's memory back
    torch.cuda.empty_cache()
    return result


def bytes_per_step(model: LlamaForCausalLM, kv_dtype: torch.dtype, context: int) -> int:
    """What one batch-1 decode step reads: each parameter once (weights in their stored
    dtype, with their scales), one row of the embedding table, and `context` tokens of KV."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    total += embed.shape[1] * embed.element_size()
    return total + context * kv_bytes_per_token(model.config, kv_dtype, model.num_kv_heads)


def table_rows(result: dict[str, Any]) -> list[tuple[str, str]]:
    """gpu_bench's table: one row per format that ran."""
    rows = []
    for name in FORMATS:
        r = result.get(name)
        if not isinstance(r, dict) or "decode_tok_s" not in r:
            continue
        vs = f", {r['vs_bf16']:.2f}x bf16" if "vs_bf16" in r else ""
        rows.append(
            (
                f"batch-1 decode tok/s, {name} weights",
                f"{r['decode_tok_s']:.1f} = {100 * r['share_of_roofline']:.0f}% of its roofline "
                f"{r['roofline_tok_s']:.0f}{vs}",
            )
        )
    return rows
