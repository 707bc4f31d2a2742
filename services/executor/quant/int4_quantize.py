"""The project's own int4 quantizer: round-to-nearest per group, written in the AWQ and GPTQ
checkpoint layouts (services/executor/quant/int4_layouts.py describes them), so that tests
build quantized checkpoints of tiny models without downloading any.

There is no calibration: AWQ's activation-aware scaling and GPTQ's error feedback change which
integers are chosen, never the layout. Act-order (GPTQ desc_act) quantises the input channels
in descending order of their weights' norm (a stand-in for the Hessian diagonal GPTQ sorts
by), so g_idx is a genuine permutation of groups. GPTQ's Hessian is the input's, so the
projections that read one input (q/k/v, gate/up) share one order, as here: their norms are
summed.
"""

from __future__ import annotations

import re
from typing import Any, NamedTuple

import torch

from kernels.w4a16 import PACK, pack_int4
from services.executor.quant.int4_layouts import AWQ_ORDER

# decoder projections; embeddings, norms and lm_head stay in full precision, as in AutoAWQ's
# and AutoGPTQ's outputs
QUANTIZED = re.compile(r"\.layers\.\d+\..*_proj\.weight$")


class Quantized(NamedTuple):
    tensors: dict[str, torch.Tensor]  # the checkpoint's names without the module prefix
    dense: torch.Tensor  # [N, K] fp32: what those tensors dequantise to


class _Groups(NamedTuple):
    q: torch.Tensor  # [N, K] int64 0..15, x's column order
    scales: torch.Tensor  # [G, N] fp16
    zeros: torch.Tensor  # [G, N] int64 0..15
    gid: torch.Tensor  # [K] int64: each input channel's group
    dense: torch.Tensor  # [N, K] fp32


def _quantize(
    w: torch.Tensor, order: torch.Tensor, group_size: int, *, sym: bool, min_zero: int = 0
) -> _Groups:
    """Groups of `group_size` (-1: all) consecutive channels of `order`; min_zero: the least
    zero point (GPTQ v1 stores zero - 1 in a nibble, so its asymmetric ones start at 1)."""
    n, k = w.shape
    group_size = k if group_size < 0 else group_size  # -1: per output channel, one group
    w = w.float()
    wp = w[:, order]
    q = torch.empty(n, k, dtype=torch.int64)
    groups = -(-k // group_size)
    scales = torch.empty(groups, n, dtype=torch.float16)
    zeros = torch.empty(groups, n, dtype=torch.int64)
    gid = torch.empty(k, dtype=torch.int64)
    for g in range(groups):
        cols = wp[:, g * group_size : (g + 1) * group_size]
        if sym:
            scale = cols.abs().amax(dim=1) * 2 / 15
            zero = torch.full((n,), 8, dtype=torch.int64)
        else:
            lo, hi = cols.amin(dim=1).clamp(max=0), cols.amax(dim=1).clamp(min=0)
            scale = (hi - lo) / 15
        # round the scale as stored first, so the integers are chosen for the stored scale
        scale = torch.where(scale > 0, scale, torch.ones_like(scale)).half()
        if not sym:
            zero = torch.round(-lo / scale.float()).long().clamp(min_zero, 15)
        qg = torch.round(cols / scale.float()[:, None]).long() + zero[:, None]
        chans = order[g * group_size : (g + 1) * group_size]
        q[:, chans] = qg.clamp(0, 15)
        scales[g], zeros[g], gid[chans] = scale, zero, g
    dense = (q - zeros[gid].T).float() * scales[gid].T.float()
    return _Groups(q=q, scales=scales, zeros=zeros, gid=gid, dense=dense)


def _check_shape(w: torch.Tensor) -> None:
    if w.dim() != 2 or w.shape[0] % PACK or w.shape[1] % PACK:
        raise ValueError(
            f"int4: a weight must be [N, K] with N and K multiples of 8, got {w.shape}"
        )


def awq_pack(values: torch.Tensor) -> torch.Tensor:
    """[R, C] 0..15 -> int32 [R, C/8] in AWQ's interleaved order."""
    r, c = values.shape
    return pack_int4(values.reshape(r, c // PACK, PACK)[:, :, list(AWQ_ORDER)].reshape(r, c))


def awq_tensors(w: torch.Tensor, *, group_size: int = 128) -> Quantized:
    """nn.Linear weight [N, K] -> AWQ gemm tensors: qweight [K, N/8], qzeros [G, N/8],
    scales [G, N] fp16 (zero points, no act-order: the format has neither choice)."""
    _check_shape(w)
    gr = _quantize(w, torch.arange(w.shape[1]), group_size, sym=False)
    tensors = {
        "qweight": awq_pack(gr.q.T.contiguous()),
        "qzeros": awq_pack(gr.zeros),
        "scales": gr.scales,
    }
    return Quantized(tensors=tensors, dense=gr.dense)


def act_order(norms: torch.Tensor) -> torch.Tensor:
    """Input channels in descending order of `norms` [K] (desc_act's quantisation order)."""
    return torch.argsort(norms, descending=True, stable=True)


def gptq_tensors(
    w: torch.Tensor,
    *,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    v2: bool = False,
    order: torch.Tensor | None = None,
) -> Quantized:
    """nn.Linear weight [N, K] -> GPTQ tensors: qweight [K/8, N], qzeros [G, N/8] (v1: zero - 1),
    scales [G, N] fp16, g_idx [K] int32. order: desc_act's channel order (None: this
    weight's own, `act_order` of its column norms)."""
    _check_shape(w)
    k = w.shape[1]
    if not desc_act:
        order = torch.arange(k)
    elif order is None:
        order = act_order(w.float().norm(dim=0))
    offset = 0 if v2 else 1
    gr = _quantize(w, order, group_size, sym=sym, min_zero=offset)
    tensors = {
        # packed along K: word (i, n) holds input channels 8i..8i+7 of output n
        "qweight": pack_int4(gr.q).T.contiguous(),
        "qzeros": pack_int4(gr.zeros - offset),
        "scales": gr.scales,
        "g_idx": gr.gid.to(torch.int32),
    }
    return Quantized(tensors=tensors, dense=gr.dense)


def quantize_checkpoint(
    state_dict: dict[str, torch.Tensor],
    *,
    method: str,
    group_size: int = 128,
    desc_act: bool = False,
    sym: bool = True,
    v2: bool = False,
) -> tuple[dict[str, torch.Tensor], dict[str, Any], dict[str, torch.Tensor]]:
    """A model's state dict in the AWQ or GPTQ checkpoint layout (v2: GPTQ's gptq_v2 format,
    zero points stored as they are; else v1's zero - 1).

    Returns (the quantized state dict, its `quantization_config` for config.json, the state
    dict with every quantized weight replaced by its dequantised value: the reference model).
    """
    if method not in ("awq", "gptq"):
        raise ValueError(f"int4: method must be awq or gptq, got {method!r}")
    orders = _shared_orders(state_dict) if desc_act else {}
    out: dict[str, torch.Tensor] = {}
    reference: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if not QUANTIZED.search(name):
            out[name] = reference[name] = t
            continue
        if method == "awq":
            qt = awq_tensors(t, group_size=group_size)
        else:
            qt = gptq_tensors(
                t,
                group_size=group_size,
                desc_act=desc_act,
                sym=sym,
                v2=v2,
                order=orders.get(_input_of(name)),
            )
        prefix = name.removesuffix("weight")
        out.update({prefix + key: v for key, v in qt.tensors.items()})
        reference[name] = qt.dense.to(t.dtype)
    config: dict[str, Any] = {"quant_method": method, "bits": 4, "group_size": group_size}
    if method == "awq":
        config.update(zero_point=True, version="gemm")
    else:
        fmt = "gptq_v2" if v2 else "gptq"
        config.update(desc_act=desc_act, sym=sym, checkpoint_format=fmt, static_groups=False)
    return out, config, reference


def _input_of(name: str) -> str:
    """The input a projection reads, as a key: q/k/v_proj share one, gate/up_proj one."""
    return _SHARED_INPUT.sub(lambda m: "qkv" if m[1] in "qkv" else "gate_up", name)


_SHARED_INPUT = re.compile(r"\b(q|k|v|gate|up)_proj\.weight$")


def _shared_orders(state_dict: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """desc_act's channel order per input: the summed column norms of its projections."""
    norms: dict[str, torch.Tensor] = {}
    for name, t in state_dict.items():
        if QUANTIZED.search(name):
            key = _input_of(name)
            norms[key] = norms.get(key, 0) + t.float().norm(dim=0) ** 2
    return {key: act_order(n) for key, n in norms.items()}
