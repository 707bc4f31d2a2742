"""int4 weights with 16-bit activations (w4a16): the one packed layout the kernels read, its
argument checks, the act-order column lookup the GEMV and GEMM share, and the torch reference
(dequantise, then matmul).

The layout, as AWQ and GPTQ checkpoints are converted into it at load
(services/executor/quant/int4_layouts.py):

    qweight  int32 [N, K / 8]   output features as rows, like nn.Linear's weight, so that tensor
                                parallel sharding and the loader's row-stacking of fused qkv and
                                gate_up treat it as they treat a bf16 weight; word (n, i) holds
                                q[n, 8i + j] in bits 4j..4j+3 (j = 0..7, plain order), 0..15
    scales   [N, G] fp16/bf16/fp32, G = cdiv(K, group_size): kept in the checkpoint's dtype,
                                so converting loses nothing
    zeros    uint8 [N, G]       0..16 (GPTQ v1 stores zero - 1, so 16 can occur)
    perm     int32 [K] or None  act-order: column k of the weight multiplies x[:, perm[k]];
                                -1 marks a padding column (x taken as 0)

    w[n, k] = (q[n, k] - zeros[n, k // group_size]) * scales[n, k // group_size]
    out     = x[:, perm] @ w.T

K is the packed weight's column count (a multiple of 8); with a perm it may exceed x's column
count by padding columns. group_size is a power of two from 16 to 1024 (per-channel
checkpoints are converted to groups of 128 with repeated scales).

Three kernels read it, routed by the rows of x in kernels/w4a16_matmul.py:
kernels/w4a16_gemv.py for decode (1 to kernels.gemv.MAX_M rows), kernels/w4a16_gemm.py for
larger decode batches and short extends, and kernels/w4a16_dequant.py expanding it for cuBLAS
in prefill; `w4a16_ref` is the twin of the products, `dequantize_w4` of the expansion. A
bf16/fp16 model on a GPU keeps the words shuffled for kernels/w4a16_mma.py instead (decode's
1 to 64 rows on the tensor cores' MMA; kernels/w4a16_mma_dequant.py expands them for
prefill); the plain layout's kernels serve fp32 models and shapes the MMA does not take.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels._checks import FLOAT_DTYPES, check_device, check_tensor

PACK = 8  # nibbles per int32 word
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """[R, C] integers 0..15 (C a multiple of 8) -> int32 [R, C / 8], element 8i + j of a row in
    bits 4j..4j+3 of word i."""
    rows, cols = q.shape
    if cols % PACK:
        raise ValueError(f"pack_int4: columns must be a multiple of {PACK}, got {cols}")
    nib = q.to(torch.int64).reshape(rows, cols // PACK, PACK) & 0xF
    shifts = torch.arange(0, 4 * PACK, 4, device=q.device)
    words = (nib << shifts).sum(dim=-1)
    # words are 0 .. 2^32 - 1; int32 holds them as two's complement
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def unpack_int4(words: torch.Tensor) -> torch.Tensor:
    """The inverse of pack_int4: int32 [R, C] -> uint8 [R, 8 * C], values 0..15."""
    shifts = torch.arange(0, 4 * PACK, 4, device=words.device, dtype=torch.int32)
    nib = (words[..., None] >> shifts) & 0xF
    return nib.reshape(*words.shape[:-1], words.shape[-1] * PACK).to(torch.uint8)


@triton.jit
def load_words(
    qw_ptr, s_ptr, z_ptr, rows, words, mask, stride_qn, stride_sn, stride_zn, GROUP: tl.constexpr
):
    """The packed words of weight rows `rows` (int64) and word columns `words`, any shapes
    that broadcast ([R, 1] and [1, W] for a tile; one row and [W]), with each word's scale and
    zero point as fp32 (a word's 8 columns lie in one group, GROUP / 8 neighbouring words share
    it, so these loads repeat: L1 hits)."""
    q = tl.load(qw_ptr + rows * stride_qn + words, mask=mask, other=0)
    g = words // (GROUP // 8)
    s = tl.load(s_ptr + rows * stride_sn + g, mask=mask, other=0.0).to(tl.float32)
    z = tl.load(z_ptr + rows * stride_zn + g, mask=mask, other=0).to(tl.float32)
    return q, s, z


@triton.jit
def _nibble(q, z, s, J: tl.constexpr):
    """Weight J of each word (bits 4J..4J+3) as (q - z) * s in fp32: exact integers times the
    scale, one rounding, as dequantize_w4 computes it."""
    return (((q >> (4 * J)) & 0xF).to(tl.float32) - z) * s


@triton.jit
def words_in_column_order(p0, p1, p2, p3, p4, p5, p6, p7, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """Nibble planes of [ROWS, WORDS] words (plane j: a value per word for its nibble j) as
    [ROWS, 8 * WORDS] in column order, column 8i + j from plane j of word i. tl.join stacks
    the planes along new last dimensions in the thread that holds the word (innermost
    nibbles j and j + 4, then j + 2, then j + 1, so that the flat order is j): no value leaves
    its thread, where a [ROWS, WORDS, 8] tile built by broadcasting the shifts went through
    shared memory with nine barriers a program."""
    w = tl.join(
        tl.join(tl.join(p0, p4), tl.join(p2, p6)),
        tl.join(tl.join(p1, p5), tl.join(p3, p7)),
    )  # [ROWS, WORDS, 2, 2, 2]: element (.., a, b, c) is nibble 4a + 2b + c
    return tl.reshape(w, [ROWS, WORDS * 8])


@triton.jit
def dequantize_words(q, z, s, ROWS: tl.constexpr, WORDS: tl.constexpr):
    """[ROWS, WORDS] packed words, with each word's zero point and scale (fp32), as the fp32
    weights [ROWS, 8 * WORDS] in column order."""
    return words_in_column_order(
        _nibble(q, z, s, 0), _nibble(q, z, s, 1), _nibble(q, z, s, 2), _nibble(q, z, s, 3),
        _nibble(q, z, s, 4), _nibble(q, z, s, 5), _nibble(q, z, s, 6), _nibble(q, z, s, 7),
        ROWS, WORDS,
    )  # fmt: skip


def check_weight(
    op: str,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None,
    device: torch.device | None = None,
) -> tuple[int, int]:
    """Check a weight in the layout above, all on `device` (default: qweight's); returns
    (n, k), k the weight's columns."""
    if group_size < 16 or group_size > 1024 or group_size & (group_size - 1):
        raise ValueError(
            f"{op}: group_size must be a power of two from 16 to 1024, got {group_size}"
        )
    check_tensor(
        op,
        "qweight",
        qweight,
        shape=(None, None),
        dims="[n, k / 8]",
        dtypes=(torch.int32,),
        device=device,
    )
    device = qweight.device
    n, k = qweight.shape[0], qweight.shape[1] * PACK
    groups = -(-k // group_size)
    for name, t, dtypes in (("scales", scales, SCALE_DTYPES), ("zeros", zeros, (torch.uint8,))):
        check_tensor(
            op, name, t, shape=(n, groups), dims="[n, groups]", dtypes=dtypes, device=device
        )
    if perm is not None:
        check_tensor(op, "perm", perm, shape=(k,), dims="[k]", dtypes=(torch.int32,), device=device)
    return n, k


def check_w4(
    op: str,
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    group_size: int,
    perm: torch.Tensor | None,
) -> tuple[int, int, int]:
    """Check x and a weight in the layout above; returns (m, n, k), k the weight's columns."""
    check_tensor(op, "x", x, shape=(None, None), dims="[m, k_in]", dtypes=FLOAT_DTYPES)
    check_device(op, x)
    m, k_in = x.shape
    n, k = check_weight(op, qweight, scales, zeros, group_size, perm, x.device)
    if perm is None and k_in != k:
        raise ValueError(f"{op}: x has {k_in} columns but the weight has {k}")
    return m, n, k


def dequantize_w4(
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The layout's weight as a dense [N, K] tensor of `dtype` (perm not applied)."""
    q = unpack_int4(qweight).float()
    k = q.shape[1]
    s = scales.float().repeat_interleave(group_size, dim=1)[:, :k]
    z = zeros.float().repeat_interleave(group_size, dim=1)[:, :k]
    return ((q - z) * s).to(dtype)


def gather_columns(x: torch.Tensor, perm: torch.Tensor | None) -> torch.Tensor:
    """x[:, perm], with -1 (padding) columns zero; x itself without a perm."""
    if perm is None:
        return x
    pad = perm < 0
    out = x[:, perm.clamp(min=0).long()]
    return out.masked_fill(pad, 0) if bool(pad.any()) else out


def w4a16_ref(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor,
    *,
    group_size: int,
    perm: torch.Tensor | None = None,
) -> torch.Tensor:
    """The torch twin of both kernels: dequantise in fp32, matmul in fp32, round once."""
    w = dequantize_w4(qweight, scales, zeros, group_size=group_size)
    return (gather_columns(x.float(), perm) @ w.T).to(x.dtype)
