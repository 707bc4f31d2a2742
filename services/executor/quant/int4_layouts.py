"""AWQ and GPTQ int4 checkpoints converted into the one layout the w4a16 kernels read
(kernels/w4a16.py): pure torch, run once per weight at load.

The checkpoint layouts (4-bit, K = in_features, N = out_features, g = group_size):

    AWQ  ("quant_method": "awq", "version": "gemm", "zero_point": true)
        qweight int32 [K, N/8]    packed along N in AWQ's interleaved order: nibble i of word
                                  (k, c) holds column 8c + AWQ_ORDER[i]
        qzeros  int32 [K/g, N/8]  packed the same way; the zero point itself
        scales  fp16  [K/g, N]
    GPTQ ("quant_method": "gptq", "checkpoint_format": "gptq" (v1) or "gptq_v2")
        qweight int32 [K/8, N]    packed along K in plain order: nibble j of word (i, n) holds
                                  row 8i + j
        qzeros  int32 [G, N/8]    packed along N in plain order; v1 stores zero - 1
        scales  fp16  [G, N]
        g_idx   int32 [K]         the group of each input channel; with act-order
                                  ("desc_act": true) channels were quantised in a permuted
                                  order, so a group's channels are scattered over K

Both dequantise to w[n, k] = (q[k, n] - zero[g(k), n]) * scale[g(k), n].

Act-order and tensor parallelism: the converted weight's K is sorted by group, with `perm`
telling the kernels which column of x each weight column multiplies. A row-parallel rank
(K sharded) holds x's columns [k_start, k_start + K) only, whose channels belong to groups
shared with other ranks, in runs of uneven length. So the converters take the rank's K rows
of qweight (and of g_idx) with `k_start` and the *whole* scales and qzeros, and regroup: each
run of one group is padded with zero-weight columns (perm -1) to a multiple of a group size
that keeps the padding small. Without act-order, and on a rank whose K range starts on a
group boundary, nothing is permuted or padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from kernels.w4a16 import PACK, dequantize_w4, pack_int4

# nibble i of an AWQ word holds column AWQ_ORDER[i] of its 8
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
# per-channel checkpoints become groups of this size, their one scale repeated
KERNEL_GROUP = 128
MIN_GROUP = 16  # the smallest group size the kernels take (powers of two)


@dataclass(frozen=True)
class Int4Weight:
    """One projection's weight in the kernels' layout (kernels/w4a16.py)."""

    qweight: torch.Tensor  # int32 [N, K / 8]
    scales: torch.Tensor  # [N, G], the checkpoint's dtype
    zeros: torch.Tensor  # uint8 [N, G]
    group_size: int
    perm: torch.Tensor | None  # int32 [K]: x's column of each weight column, -1 for padding
    in_features: int  # x's columns (K without padding)

    def __post_init__(self) -> None:
        n, k = self.qweight.shape[0], self.qweight.shape[1] * PACK
        groups = -(-k // self.group_size)
        assert self.scales.shape == self.zeros.shape == (n, groups)
        if self.perm is None:
            assert k == self.in_features
        else:
            assert self.perm.shape == (k,) and k >= self.in_features

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The dense [N, in_features] weight, x's column order: what the checkpoint means."""
        w = dequantize_w4(self.qweight, self.scales, self.zeros, group_size=self.group_size)
        if self.perm is not None:
            real = self.perm >= 0
            dense = w.new_zeros(w.shape[0], self.in_features)
            dense[:, self.perm[real].long()] = w[:, real]
            w = dense
        return w.to(dtype)


def _unpack_rows(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] -> int64 [R, 8C]: nibble j of word (r, c) at column 8c + j."""
    shifts = torch.arange(0, 4 * PACK, 4, dtype=torch.int32, device=words.device)
    return ((words[..., None] >> shifts) & 0xF).reshape(words.shape[0], -1).long()


def _awq_unpack(words: torch.Tensor) -> torch.Tensor:
    """AWQ-packed int32 [R, C] -> int64 [R, 8C] in plain column order."""
    nib = _unpack_rows(words).reshape(words.shape[0], -1, PACK)
    plain = torch.empty_like(nib)
    plain[:, :, list(AWQ_ORDER)] = nib  # nibble i is column AWQ_ORDER[i]
    return plain.reshape(words.shape[0], -1)


def awq_to_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    *,
    group_size: int,
    k_start: int = 0,
) -> Int4Weight:
    """An AWQ (gemm) weight in the kernels' layout.

    qweight: [K, N/8], the rows [k_start, k_start + K) of the checkpoint's (a row-parallel
    rank's share, or all of it); qzeros, scales: the checkpoint's, all groups.
    """
    q = _awq_unpack(qweight).T  # [N, K]
    zeros = _awq_unpack(qzeros)  # [G, N]
    k = q.shape[1]
    gid = _plain_groups(k_start, k, group_size, scales.shape[0]).to(q.device)
    return _regroup(q, zeros, scales, gid, group_size, k)


def gptq_to_int4(
    qweight: torch.Tensor,
    qzeros: torch.Tensor,
    scales: torch.Tensor,
    g_idx: torch.Tensor | None,
    *,
    group_size: int,
    zero_offset: int,
    k_start: int = 0,
) -> Int4Weight:
    """A GPTQ weight in the kernels' layout.

    qweight: [K/8, N], the packed rows of input channels [k_start, k_start + K); g_idx: the
    same channels' entries (None: plain groups); qzeros, scales: the checkpoint's, all groups.
    zero_offset: added to the stored zero points (1 for v1 checkpoints, 0 for gptq_v2).
    """
    if k_start % PACK:
        raise ValueError(f"GPTQ: a K shard must start on a packed word, got k_start={k_start}")
    q = _unpack_rows(qweight.T.contiguous())  # [N, K]: word (n, i) holds rows 8i..8i+7
    zeros = _unpack_rows(qzeros) + zero_offset  # [G, N]
    k = q.shape[1]
    if g_idx is None:
        gid = _plain_groups(k_start, k, group_size, scales.shape[0]).to(q.device)
    else:
        gid = g_idx.to(device=q.device, dtype=torch.int64)
        if gid.shape != (k,) or bool((gid < 0).any()) or bool((gid >= scales.shape[0]).any()):
            raise ValueError(
                f"GPTQ: g_idx must hold {k} group indices below {scales.shape[0]}, "
                f"got shape {tuple(gid.shape)}"
            )
    return _regroup(q, zeros, scales, gid, group_size, k)


def _plain_groups(k_start: int, k: int, group_size: int, num_groups: int) -> torch.Tensor:
    """Each channel's group without act-order: (k_start + k) // group_size."""
    if group_size < 0:
        return torch.zeros(k, dtype=torch.int64)
    gid = torch.arange(k_start, k_start + k) // group_size
    if k and int(gid[-1]) >= num_groups:
        raise ValueError(
            f"channels {k_start}..{k_start + k - 1} need {int(gid[-1]) + 1} groups of "
            f"{group_size}, the checkpoint has {num_groups}"
        )
    return gid


def _regroup(
    q: torch.Tensor,  # [N, K] 0..15, x's column order
    zeros: torch.Tensor,  # [G_all, N]
    scales: torch.Tensor,  # [G_all, N]
    gid: torch.Tensor,  # [K] group of each channel
    group_size: int,
    k: int,
) -> Int4Weight:
    if group_size < 0:  # per channel: the one group repeated as groups the kernels take
        group_size = KERNEL_GROUP
        reps = -(-k // group_size)
        scales, zeros = scales[:1].expand(reps, -1), zeros[:1].expand(reps, -1)
        gid = torch.arange(k, device=q.device) // group_size
    if group_size < MIN_GROUP or group_size & (group_size - 1):
        raise ValueError(f"int4: group_size must be -1 or a power of two >= 16, got {group_size}")
    if bool((zeros > 16).any()):
        raise ValueError("int4: zero points must be 0..16")
    first = int(gid[0]) if k else 0
    plain = torch.arange(k, device=q.device) // group_size + first
    if torch.equal(gid, plain):
        # groups contiguous and aligned: the checkpoint's order, its groups [first, ...)
        rows = slice(first, first + -(-k // group_size))
        return Int4Weight(
            qweight=pack_int4(q),
            scales=scales[rows].T.contiguous(),
            zeros=zeros[rows].T.contiguous().to(torch.uint8),
            group_size=group_size,
            perm=None,
            in_features=k,
        )
    return _sorted_by_group(q, zeros, scales, gid, group_size, k)


def _sorted_by_group(
    q: torch.Tensor,
    zeros: torch.Tensor,
    scales: torch.Tensor,
    gid: torch.Tensor,
    group_size: int,
    k: int,
) -> Int4Weight:
    """Channels sorted by group, each group's run padded to a multiple of the kernel group
    size (chosen to pad least; ties go to the larger)."""
    order = torch.sort(gid, stable=True).indices
    runs_gid, runs_len = torch.unique_consecutive(gid[order], return_counts=True)
    sizes = [s for s in (group_size, 64, 32, MIN_GROUP) if s <= group_size]
    padded = {s: int(((runs_len + s - 1) // s * s).sum()) for s in sizes}
    vg = min(sizes, key=lambda s: (padded[s], -s))
    perm = torch.full((padded[vg],), -1, dtype=torch.int64, device=q.device)
    vgid = torch.empty(padded[vg] // vg, dtype=torch.int64, device=q.device)  # their groups
    pos = 0
    for g, n in zip(runs_gid.tolist(), runs_len.tolist(), strict=True):
        span = -(-n // vg) * vg
        perm[pos : pos + n] = order[:n]
        vgid[pos // vg : (pos + span) // vg] = g
        order = order[n:]
        pos += span
    real = perm >= 0
    z = zeros[vgid].T  # [N, G']
    if padded[vg] == k and torch.equal(perm, torch.arange(k, device=q.device)):
        # in order already, only split unevenly (a shard not starting on a group boundary)
        return Int4Weight(
            qweight=pack_int4(q),
            scales=scales[vgid].T.contiguous(),
            zeros=z.contiguous().to(torch.uint8),
            group_size=vg,
            perm=None,
            in_features=k,
        )
    # padding columns meet x = 0 (perm -1); their nibble is the zero point, so w = 0 as well
    q_sorted = z.repeat_interleave(vg, dim=1).clone()
    q_sorted[:, real] = q[:, perm[real]]
    return Int4Weight(
        qweight=pack_int4(q_sorted.clamp(max=15)),
        scales=scales[vgid].T.contiguous(),
        zeros=z.contiguous().to(torch.uint8),
        group_size=vg,
        perm=perm.to(torch.int32),
        in_features=k,
    )


@dataclass(frozen=True)
class Int4Config:
    """A checkpoint's int4 `quantization_config`, checked: what the converters need."""

    method: str  # "awq" or "gptq"
    group_size: int  # -1: per channel
    zero_offset: int  # added to stored zero points (GPTQ v1: 1)
    desc_act: bool

    @classmethod
    def parse(cls, cfg: dict[str, Any]) -> Int4Config:
        """Raise ValueError naming the key for anything the converters cannot read."""
        method = str(cfg.get("quant_method", "")).lower()
        if method not in ("awq", "gptq"):
            raise ValueError(f"int4: quant_method must be awq or gptq, got {method!r}")
        for key in ("lm_head", "dynamic"):  # a quantized LM head; per-module bits (GPTQModel)
            if cfg.get(key):
                raise ValueError(f"{method}: {key}={cfg[key]!r} is not supported")
        bits = cfg.get("bits", cfg.get("w_bit"))
        if bits != 4:
            raise ValueError(f"{method}: only 4-bit weights are supported, got bits={bits!r}")
        group = int(cfg.get("group_size", cfg.get("q_group_size", -1)))
        if group != -1 and (group < MIN_GROUP or group & (group - 1)):
            raise ValueError(
                f"{method}: group_size must be -1 or a power of two >= 16, got {group}"
            )
        if method == "awq":
            version = str(cfg.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(
                    f"awq: only the gemm packing is supported, got version={version!r}"
                )
            if not cfg.get("zero_point", True):
                raise ValueError(
                    "awq: checkpoints without zero points (zero_point=False) are not supported"
                )
            return cls(method=method, group_size=group, zero_offset=0, desc_act=False)
        fmt = str(cfg.get("checkpoint_format", "gptq")).lower()
        if fmt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq: checkpoint_format must be gptq or gptq_v2, got {fmt!r}")
        return cls(
            method=method,
            group_size=group,
            zero_offset=1 if fmt == "gptq" else 0,
            desc_act=bool(cfg.get("desc_act", False)),
        )
