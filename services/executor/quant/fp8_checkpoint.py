"""Writing an fp8 checkpoint from a float one, in the layouts radixserve reads: the tests'
quantizer, and a way to make a checkpoint that loads without quantizing at every start.

    python -m services.executor.quant.fp8_checkpoint SRC DST --scheme {tensor,channel,block}

Every projection (a module whose name ends in `_proj`, DeepSeek's kv_a_proj_with_mqa and
Mixtral's experts' w1, w2, w3) is quantized; embeddings, norms, the
LM head and MoE routers are copied as they are. tensor and channel are written as
compressed-tensors does (`weight_scale`, dynamic per-token activations, or static per-tensor
`input_scale` with --static-input-scale 1.0); block as DeepSeek-V3 and Qwen3-FP8 are
(`quant_method: fp8`, `weight_block_size: [128, 128]`, `weight_scale_inv`).
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from kernels.fp8_weights import quantize_blocks, quantize_rows, quantize_tensor

IGNORE = ["lm_head"]
MIXTRAL_EXPERTS = ("w1", "w2", "w3")  # Mixtral's experts' projections (gate, down, up)


def quantization_config(scheme: str, static_input: bool = False) -> dict[str, Any]:
    """config.json's `quantization_config` for an fp8 checkpoint of `scheme`."""
    if scheme == "block":
        return {
            "quant_method": "fp8",
            "fmt": "e4m3",
            "activation_scheme": "dynamic",
            "weight_block_size": [128, 128],
            "modules_to_not_convert": IGNORE,
        }
    activations = {"type": "float", "num_bits": 8, "symmetric": True}
    activations.update(
        {"strategy": "tensor", "dynamic": False}
        if static_input
        else {"strategy": "token", "dynamic": True}
    )
    weights = {"type": "float", "num_bits": 8, "symmetric": True, "strategy": scheme}
    return {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": weights,
                "input_activations": activations,
            }
        },
        "ignore": IGNORE,
    }


def quantize_state(
    state: dict[str, torch.Tensor], scheme: str, static_input: float | None = None
) -> dict[str, torch.Tensor]:
    """The checkpoint tensors of `state` in fp8 `scheme` (see the module's docstring)."""
    out: dict[str, torch.Tensor] = {}
    for name, t in state.items():
        module, _, kind = name.rpartition(".")
        leaf = module.rpartition(".")[2]
        projection = leaf.endswith(("_proj", "_proj_with_mqa")) or leaf in MIXTRAL_EXPERTS
        if kind != "weight" or not projection or t.dim() != 2:
            out[name] = t
            continue
        if scheme == "block":
            out[name], out[f"{module}.weight_scale_inv"] = quantize_blocks(t)
            continue
        quantize = quantize_tensor if scheme == "tensor" else quantize_rows
        out[name], out[f"{module}.weight_scale"] = quantize(t)
        if static_input is not None:
            out[f"{module}.input_scale"] = torch.tensor([static_input])
    return out


def write_fp8_checkpoint(
    src: str | Path, dst: str | Path, scheme: str, static_input: float | None = None
) -> Path:
    """Quantize the safetensors checkpoint in `src` into `dst` (other files copied); returns
    dst. static_input: a calibrated activation scale for every projection (tensor and
    channel schemes), else activations are quantized per token at run time."""
    if scheme not in ("tensor", "channel", "block"):
        raise ValueError(f"scheme {scheme!r}: one of tensor, channel, block")
    if static_input is not None and scheme == "block":
        raise ValueError("block checkpoints quantize activations per token (dynamic) only")
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name != "config.json":
            shutil.copy(f, dst / f.name)
    for f in sorted(src.glob("*.safetensors")):
        save_file(quantize_state(load_file(f), scheme, static_input), dst / f.name)
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = quantization_config(scheme, static_input is not None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    return dst


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m services.executor.quant.fp8_checkpoint")
    p.add_argument("src", help="a float HF checkpoint directory (safetensors)")
    p.add_argument("dst", help="where the fp8 checkpoint is written")
    p.add_argument("--scheme", choices=["tensor", "channel", "block"], default="channel")
    p.add_argument("--static-input-scale", type=float, default=None)
    a = p.parse_args(argv)
    print(write_fp8_checkpoint(a.src, a.dst, a.scheme, a.static_input_scale))


if __name__ == "__main__":
    main()
