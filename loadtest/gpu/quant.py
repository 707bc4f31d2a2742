"""gpu_bench section quant_decode: batch-1 decode (in 128, out 256) at Llama-3.1-8B's shapes
with dummy weights in each weight format, in tok/s and as a share of that format's own
roofline: the bytes a decode step actually reads (every parameter but the embedding table,
of which one row; the KV cache at the run's mean context) over the copy bandwidth measured
in the same run.

Formats are a table (`FORMATS`): a name, the offline benchmark's flags, and what
config.json's quantization_config says; adding a format is one line. GGUF Q4_K runs from
config.json too (quant_method "gguf", quant/gguf_config.py): random valid blocks at the
model's shapes, taken as a .gguf file's are (a bf16 model's Q4_K projections converted at load
for the int4 MMA, services/executor/quant/gguf_linear.py; RADIXSERVE_Q4K_MMA=0 keeps the
blocks and their kernels, to compare in one tree). int4 (AWQ, GPTQ)
weights count what the w4a16 kernels read: the packed words, fp16 scales and uint8 zero
points of each group of 128 (the parameters after load, so the roofline is the format's
own). Each section loads a few 8B models, bf16 first for the ratio (`SECTIONS`): all of
them would not fit one section's time.

Section quant_decode_act_order: bf16, int4 GPTQ and int4 GPTQ with act-order (desc_act).
Section quant_decode_batch8: the same decode with 8 requests at once (bf16, int4 AWQ, GGUF
Q4_K), past the GEMV's rows; quant_decode_batch8_fp8 the same with fp8 weights. Section
quant_prefill_int4: the same engine's one-prompt prefill (PREFILL_IN tokens, a few decode steps
after it) with bf16, int4 AWQ and GGUF Q4_K weights, in prompt tokens a second and against bf16:
prefill multiplies thousands of rows by each weight, where the quantized formats expand their
weights for cuBLAS (kernels/w4a16_dequant.py, kernels/gguf_dequant.py).
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
PREFILL_IN, PREFILL_OUT = 4096, 4


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
    # act-order (desc_act): the dummy weights get a random order of x's columns, which every
    # product applies to x first (kernels/gather_cols.py)
    "int4_gptq_act": WeightFormat(
        (),
        {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True, "sym": True},
    ),
}


class Section(NamedTuple):
    formats: tuple[str, ...]
    input_len: int
    output_len: int
    figure: str  # the result key compared with bf16's
    batch_size: int = 1


# gpu_bench section -> the formats it runs, and how
SECTIONS: dict[str, Section] = {
    "quant_decode": Section(
        ("bf16", "fp8_channel", "fp8_block", "gguf_q4_k"), IN_LEN, OUT_LEN, "decode_tok_s"
    ),
    "quant_decode_int4": Section(
        ("bf16", "int4_awq", "int4_gptq"), IN_LEN, OUT_LEN, "decode_tok_s"
    ),
    "quant_decode_act_order": Section(
        ("bf16", "int4_gptq", "int4_gptq_act"), IN_LEN, OUT_LEN, "decode_tok_s"
    ),
    "quant_prefill_int4": Section(
        ("bf16", "int4_awq", "gguf_q4_k"), PREFILL_IN, PREFILL_OUT, "prefill_tok_s"
    ),
    # decode batches past the GEMV's 4 rows: int4 weights take the MMA (bf16 and fp16 models;
    # the tensor-core GEMM before it), GGUF blocks are expanded for cuBLAS
    "quant_decode_batch8": Section(
        ("bf16", "int4_awq", "gguf_q4_k"), IN_LEN, OUT_LEN, "decode_tok_s", batch_size=8
    ),
    # fp8 weights past the GEMV's rows: torch._scaled_mm with per-token activation scales
    # (per channel), the Triton block-scale GEMM (blocks)
    "quant_decode_batch8_fp8": Section(
        ("bf16", "fp8_channel", "fp8_block"), IN_LEN, OUT_LEN, "decode_tok_s", batch_size=8
    ),
    # int4 decode batches on the MMA (kernels/w4a16_mma.py: 4 tiles of 8 rows of x at 32, 8 at
    # 64) against bf16's cuBLAS
    "quant_decode_batch32": Section(
        ("bf16", "int4_awq"), IN_LEN, OUT_LEN, "decode_tok_s", batch_size=32
    ),
    "quant_decode_batch64": Section(
        ("bf16", "int4_awq"), IN_LEN, OUT_LEN, "decode_tok_s", batch_size=64
    ),
}


def quant_decode_section(section: Section = SECTIONS["quant_decode"]) -> dict[str, Any]:
    bandwidth = copy_bandwidth()
    out: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(),
        "copy_bandwidth_TBps": bandwidth / 1e12,
    }
    for name in section.formats:
        out[name] = decode_one(name, FORMATS[name], bandwidth, section)
    base = out.get("bf16", {}).get(section.figure)
    for name in section.formats:
        if base:
            out[name]["vs_bf16"] = out[name][section.figure] / base
    return out


def pool_tokens(section: Section) -> int:
    """The KV pool a section's engine gets: 8,192 tokens, or every request's whole context
    with a page of slack each where the batch needs more (64 x 384 tokens at batch 64)."""
    return max(8192, section.batch_size * (section.input_len + section.output_len + 64))


def model_dir(fmt: WeightFormat) -> Path:
    """A new directory of Llama-3.1-8B's config (and tokenizer) in the format's checkpoint
    layout: its quantization_config in config.json (dummy weights are drawn at load)."""
    model = llama8b_dir(Path(tempfile.mkdtemp()))
    if fmt.quantization_config is not None:
        config = json.loads((model / "config.json").read_text())
        config["quantization_config"] = fmt.quantization_config
        (model / "config.json").write_text(json.dumps(config))
    return model


def decode_one(
    name: str, fmt: WeightFormat, bandwidth: float, section: Section = SECTIONS["quant_decode"]
) -> dict[str, Any]:
    model = model_dir(fmt)
    args = offline.parse_args(
        [
            *("latency", "--model", str(model), "--load-format", "dummy"),
            *("--batch-size", str(section.batch_size), "--input-len", str(section.input_len)),
            *("--output-len", str(section.output_len)),
            # three models in one process: small pools (a prompt of PREFILL_IN fits one step),
            # large enough for every request of the batch to its last token
            *("--max-total-tokens", str(pool_tokens(section))),
            *("--max-prefill-tokens", "8192"),
            *fmt.flags,
        ]
    )
    engine = offline.make_engine(args)
    result = offline.run_latency(engine, args)
    # the mean context of the decode steps
    context = section.input_len + section.output_len // 2
    step_bytes = bytes_per_step(
        engine.runner.model, engine.policy.kv.dtype, context, section.batch_size
    )
    roofline = section.batch_size * bandwidth / step_bytes  # tokens a second
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


def bytes_per_step(
    model: LlamaForCausalLM, kv_dtype: torch.dtype, context: int, batch: int = 1
) -> int:
    """What one decode step of `batch` requests reads: each parameter once (weights in their
    stored dtype, with their scales), one row of the embedding table and `context` tokens of
    KV per request."""
    embed = model.model.embed_tokens.weight
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p is not embed)
    total += batch * embed.shape[1] * embed.element_size()
    kv = context * kv_bytes_per_token(model.config, kv_dtype, model.num_kv_heads)
    return total + batch * kv


def table_rows(result: dict[str, Any], prefill: bool = False) -> list[tuple[str, str]]:
    """gpu_bench's table: one row per format that ran (its prefill, for a prefill section)."""
    rows = []
    for name in FORMATS:
        r = result.get(name)
        if not isinstance(r, dict) or "decode_tok_s" not in r:
            continue
        vs = f", {r['vs_bf16']:.2f}x bf16" if "vs_bf16" in r else ""
        if prefill:
            rows.append(
                (
                    f"prefill of {r['input_len']} tokens, {name} weights",
                    f"{r['prefill_tok_s']:.0f} tok/s ({1000 * r['prefill_s']:.1f} ms){vs}",
                )
            )
            continue
        rows.append(
            (
                f"batch-{r['batch_size']} decode tok/s, {name} weights",
                f"{r['decode_tok_s']:.1f} = {100 * r['share_of_roofline']:.0f}% of its roofline "
                f"{r['roofline_tok_s']:.0f}{vs}",
            )
        )
    return rows
