"""The int4 decode MMA (kernels/w4a16_mma.py) against its torch twin: the shuffled layout's
meaning, every row count it takes in fp16 and bf16, group sizes, splits of K, strided rows and
outputs, w4a16_matmul's routing to it, and bad arguments. In the interpreter the kernel's
`EMULATE` sums run; on a GPU the inline PTX MMAs do."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from kernels.w4a16 import pack_int4, unpack_int4
from kernels.w4a16_dequant import w4a16_dequantize
from kernels.w4a16_matmul import w4a16_mma_matmul
from kernels.w4a16_mma import (
    MAX_M,
    mma_ahead,
    mma_split,
    shuffle_w4,
    split_at_most,
    unshuffle_w4,
    w4a16_mma,
    zsub_default,
)
from kernels.w4a16_mma_dequant import w4a16_mma_dequantize
from tests.kernels.helpers import DEVICE, poison
from tests.kernels.test_w4a16 import W4

HALF = [pytest.param(torch.float16, id="fp16"), pytest.param(torch.bfloat16, id="bf16")]


def _check(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> None:
    """fp32 sums in another order than the twin's, one rounding to x's dtype: within that
    rounding of the row's largest output."""
    eps = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    scale = want.abs().amax(dim=-1, keepdim=True).clamp_min(1e-3)
    err = ((got.float() - want.float()).abs() / scale).max().item()
    assert err <= 2 * eps, f"error {err} of the row's largest output (dtype {dtype})"


@pytest.mark.parametrize("group", [64, 32])
def test_the_shuffled_words_hold_each_weight_where_the_layout_says(group: int) -> None:
    """Bits 4j..4j+3 (j = 4e + 2h + r) of word [t, c, 4g + p, v] hold the weight of row
    16t + g + 8r and column 64c + 16p + 4v + 2h + e (groups of 32: 64c + 32 (v // 2) + 8p +
    4 (v % 2) + 2h + e, each step inside one group), for every weight of a 32 x 256 matrix;
    unshuffled, the plain words again."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randint(0, 16, (32, 256), generator=gen)
    shuffled = shuffle_w4(pack_int4(q), group_size=group)
    assert torch.equal(unshuffle_w4(shuffled, group_size=group), pack_int4(q))
    words = shuffled.to(torch.int64) & 0xFFFFFFFF
    assert words.shape == (2, 4, 32, 4)
    t, c, lane, v, j = torch.meshgrid(*(torch.arange(s) for s in (2, 4, 32, 4, 8)), indexing="ij")
    g, p = lane // 4, lane % 4
    e, h, r = j // 4, (j // 2) % 2, j % 2
    rows = 16 * t + g + 8 * r
    if group == 32:
        cols = 64 * c + 32 * (v // 2) + 8 * p + 4 * (v % 2) + 2 * h + e
        assert torch.equal((cols % 64) // 32, v // 2)  # a step's 16 columns in one group
    else:
        cols = 64 * c + 16 * p + 4 * v + 2 * h + e
    nibbles = (words[t, c, lane, v] >> (4 * j)) & 0xF
    assert torch.equal(nibbles, q[rows, cols])
    # every weight appears exactly once
    assert torch.equal(torch.sort((rows * 256 + cols).flatten()).values, torch.arange(32 * 256))


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("m", "split"), [(1, None), (3, 2), (9, None), (30, 4), (MAX_M, None)])
def test_groups_of_32_with_zero_points_or_mins(
    dtype: torch.dtype, m: int, split: int | None
) -> None:
    """Groups of 32 columns (two a chunk, their own layout) with AWQ's zero points, and with
    float mins instead (w = s q - m, GGUF's Q4_K once its 6-bit scales and mins are applied),
    against the twin."""
    gen = torch.Generator().manual_seed(m)
    w = W4(48, 512, 32, gen)
    qm = shuffle_w4(w.qweight, group_size=32)
    x = torch.randn(m, 512, generator=gen).to(DEVICE, dtype)
    got = w4a16_mma(x, qm, w.scales, w.zeros, group_size=32, split=split)
    _check(got, w.ref(x.float()), dtype)
    q = unpack_int4(w.qweight).float()
    s = w.scales.float().repeat_interleave(32, dim=1)
    mins = (torch.rand(48, 16, generator=gen) * 0.1).to(DEVICE, torch.float16)
    want = x.float() @ (s * q - mins.float().repeat_interleave(32, dim=1)).T
    got = w4a16_mma(x, qm, w.scales, None, group_size=32, split=split, mins=mins)
    _check(got, want, dtype)
    # the zero points as mins (s z) give the zero points' sums
    as_mins = (w.scales.float() * w.zeros.float()).to(torch.float16)
    want = x.float() @ (s * q - (w.scales.float() * w.zeros.float()).repeat_interleave(32, 1)).T
    _check(w4a16_mma(x, qm, w.scales, None, group_size=32, mins=as_mins), want, dtype)


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize(("m", "split"), [(1, None), (2, 1), (9, None), (24, 2), (MAX_M, None)])
def test_mins_of_x_type_take_the_scales_inside_a(
    dtype: torch.dtype, m: int, split: int | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups of 32 with scales and mins of x's type (GGUF Q4_K converted for a 16-bit model):
    natively the scales go inside the A fragments (s q rounded once to x's type) and the mins
    through a second MMA, no groups' sums folded; against the twin with those weights (the
    interpreter's sums, s q - m exact, against the exact weights)."""
    gen = torch.Generator().manual_seed(100 + m)
    n, k = 48, 1024
    q = torch.randint(0, 16, (n, k), generator=gen)
    s = (torch.rand(n, k // 32, generator=gen) * 0.02 + 0.001).to(DEVICE, dtype)
    mins = (torch.rand(n, k // 32, generator=gen) * 0.2).to(DEVICE, dtype)
    qm = shuffle_w4(pack_int4(q).to(DEVICE), group_size=32)
    x = torch.randn(m, k, generator=gen).to(DEVICE, dtype)
    native = torch.device(DEVICE).type == "cuda"
    launched = _spy_launches(monkeypatch)
    exact = s.float().repeat_interleave(32, dim=1) * q.to(DEVICE).float()
    sq = exact.to(dtype).float() if native else exact
    want = x.float() @ (sq - mins.float().repeat_interleave(32, dim=1)).T
    got = w4a16_mma(x, qm, s, None, group_size=32, split=split, mins=mins)
    _check(got, want, dtype)
    assert (launched[-1]["SM"], launched[-1]["G32_CPB"]) == ((True, 2) if native else (False, 1))
    # fp16 mins with bf16 x, or blocks of one chunk (k's chunks odd): each group's sums folded
    if dtype == torch.bfloat16:
        w4a16_mma(x, qm, s, None, group_size=32, mins=mins.half())
        assert (launched[-1]["SM"], launched[-1]["G32_CPB"]) == (False, 1)
    got1 = w4a16_mma(x[:, :960], qm[:, :15].contiguous(), s[:, :30].contiguous(), None,
                     group_size=32, mins=mins[:, :30].contiguous())  # fmt: skip
    assert (launched[-1]["SM"], launched[-1]["G32_CPB"]) == (False, 1)
    want1 = x[:, :960].float() @ (exact[:, :960] - mins[:, :30].float().repeat_interleave(32, 1)).T
    _check(got1, want1, dtype)


def _spy_launches(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, object]]:
    """The keyword arguments (constexprs) of every `w4a16_mma` kernel launch from now on."""
    import kernels.w4a16_mma as km

    kernel, seen = km._w4a16_mma_kernel, []

    class Spy:
        def __getitem__(self, grid: tuple[int, ...]) -> Callable[..., object]:
            def launch(*args: object, **kwargs: object) -> object:
                seen.append(kwargs)
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(km, "_w4a16_mma_kernel", Spy())
    return seen


@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("m", [1, 2, 3, 5, 8, 9, 17, 40, MAX_M])
def test_every_row_count_against_the_twin(dtype: torch.dtype, m: int) -> None:
    gen = torch.Generator().manual_seed(m)
    w = W4(48, 512, 128, gen)
    x = torch.randn(m, 512, generator=gen).to(DEVICE, dtype)
    got = w4a16_mma(x, shuffle_w4(w.qweight), w.scales, w.zeros, group_size=128)
    assert got.shape == (m, 48) and got.dtype == dtype
    _check(got, w.ref(x.float()), dtype)


@pytest.mark.parametrize(
    ("group", "split", "scale_dtype"),
    [
        (64, 1, torch.float16),
        (64, 4, torch.bfloat16),
        (256, 2, torch.float32),
        (512, 1, torch.float16),
    ],
)
def test_groups_splits_and_scale_dtypes(group: int, split: int, scale_dtype: torch.dtype) -> None:
    """Groups of 64 (one chunk) to 512 columns, K split across 1 to 4 warps (each a run of
    whole groups), scales in every dtype the layout keeps, zero points up to 16 (GPTQ v1)."""
    gen = torch.Generator().manual_seed(group + split)
    w = W4(32, 1024, group, gen, scale_dtype=scale_dtype)
    x = torch.randn(4, 1024, generator=gen).to(DEVICE, torch.bfloat16)
    got = w4a16_mma(x, shuffle_w4(w.qweight), w.scales, w.zeros, group_size=group, split=split)
    _check(got, w.ref(x.float()), torch.bfloat16)


@pytest.mark.parametrize(
    ("m", "split", "ahead", "zsub", "x_ahead"),
    [(1, 1, 1, False, 0), (1, 2, 8, True, 3), (3, 4, 5, False, 1), (12, 1, 4, False, None),
     (12, 2, 2, True, 2), (30, 2, 16, False, None), (64, 1, 3, True, 1), (64, 4, 2, False, 0)],
)  # fmt: skip
def test_operands_in_flight_and_the_zero_points(
    m: int, split: int, ahead: int, zsub: bool, x_ahead: int | None
) -> None:
    """Chunks of words loaded 1 to 16 ahead of the one multiplied, past the end of a warp's
    run (16 and 8 ahead of runs of 8 chunks; clamped to its last chunk), x 0 to 3 ahead, and
    the zero points taken off inside A or by the MMAs against ones, for 1, 2, 4 and 8 tiles
    of x: the twin's sums. Groups of 64 (one chunk a group) so that the group loop carries
    the operands in flight."""
    gen = torch.Generator().manual_seed(m + ahead)
    w = W4(32, 1024, 64, gen)
    qm = shuffle_w4(w.qweight)
    x = torch.randn(m, 1024, generator=gen).to(DEVICE, torch.bfloat16)
    got = w4a16_mma(x, qm, w.scales, w.zeros, group_size=64, split=split, ahead=ahead, zsub=zsub,
                    x_ahead=x_ahead)  # fmt: skip
    _check(got, w.ref(x.float()), torch.bfloat16)


def test_strided_rows_and_a_strided_output() -> None:
    """x's rows with a stride (a view into a wider buffer), out a column slice of a wider
    tensor: the stride is followed and nothing outside the slice is written."""
    gen = torch.Generator().manual_seed(7)
    w = W4(32, 256, 128, gen)
    wide = torch.randn(3, 320, generator=gen).to(DEVICE, torch.float16)
    x = wide[:, 8:264]
    buf = poison(torch.empty(3, 40, dtype=torch.float16, device=DEVICE))
    before = buf.clone()
    w4a16_mma(x, shuffle_w4(w.qweight), w.scales, w.zeros, group_size=128, out=buf[:, 4:36])
    _check(buf[:, 4:36], w.ref(x.float()), torch.float16)
    assert torch.equal(buf[:, :4].view(torch.int16), before[:, :4].view(torch.int16))
    assert torch.equal(buf[:, 36:].view(torch.int16), before[:, 36:].view(torch.int16))


def test_the_same_bits_every_call_and_whatever_the_batch_holds() -> None:
    """A fixed order of sums: two calls give the same bits, and a row's outputs do not depend
    on the other rows of x (a request's tokens do not change with its batch)."""
    gen = torch.Generator().manual_seed(3)
    w = W4(32, 512, 128, gen)
    qm = shuffle_w4(w.qweight)
    x = torch.randn(8, 512, generator=gen).to(DEVICE, torch.bfloat16)
    a = w4a16_mma(x, qm, w.scales, w.zeros, group_size=128)
    b = w4a16_mma(x, qm, w.scales, w.zeros, group_size=128)
    alone = w4a16_mma(x[5:6].contiguous(), qm, w.scales, w.zeros, group_size=128)
    assert torch.equal(a, b)
    assert torch.equal(a[5:6], alone)


@pytest.mark.parametrize("act_order", [False, True])
def test_w4a16_mma_matmul_routes_by_rows(act_order: bool) -> None:
    """The shuffled words' products: up to 64 rows the MMA's bits (after the act-order gather
    of x's columns, padding columns 0), past that the weight expanded from the shuffled words
    (in slices of whole tiles) for a dense product: both against the twin."""
    gen = torch.Generator().manual_seed(11)
    w = W4(48, 512, 128, gen, act_order=act_order)
    qm = shuffle_w4(w.qweight)
    for m in (1, 8, 24, 64, 65):
        x = torch.randn(m, w.k_in, generator=gen).to(DEVICE, torch.float16)
        got = w4a16_mma_matmul(
            x, qm, w.scales, w.zeros, group_size=128, perm=w.perm, chunk_elems=16 * 512
        )
        _check(got, w.ref(x.float()), torch.float16)
        if m <= MAX_M:
            xs = x if w.perm is None else x[:, w.perm.clamp_min(0).long()] * (w.perm >= 0)
            mma = w4a16_mma(xs.contiguous(), qm, w.scales, w.zeros, group_size=128)
            assert torch.equal(got, mma)


def test_w4a16_mma_matmul_takes_views_the_kernel_refuses() -> None:
    """A view of x whose rows start off a 16-byte boundary (the kernel's 16-byte loads refuse
    it) is copied first: the same products as the aligned x."""
    gen = torch.Generator().manual_seed(13)
    w = W4(32, 256, 128, gen)
    qm = shuffle_w4(w.qweight)
    wide = torch.randn(3 * 256 + 2, generator=gen).to(DEVICE, torch.float16)
    x = wide[2:].view(3, 256)  # 4 bytes past an aligned start
    assert x.data_ptr() % 16
    got = w4a16_mma_matmul(x, qm, w.scales, w.zeros, group_size=128)
    want = w4a16_mma(x.clone(), qm, w.scales, w.zeros, group_size=128)
    assert torch.equal(got, want)
    # a launch's split (the start-up timing's) lowered to what k's two groups allow
    got = w4a16_mma_matmul(x, qm, w.scales, w.zeros, group_size=128, split=8)
    assert torch.equal(got, w4a16_mma(x.clone(), qm, w.scales, w.zeros, group_size=128, split=2))


def test_the_shuffled_words_unshuffle_and_expand_as_the_plain_ones() -> None:
    """unshuffle_w4 inverts shuffle_w4; the expansion from the shuffled words gives the plain
    layout's expansion (kernels/w4a16_dequant) bit for bit, in slices of tiles too."""
    gen = torch.Generator().manual_seed(5)
    w = W4(64, 1024, 128, gen)
    qm = shuffle_w4(w.qweight)
    assert torch.equal(unshuffle_w4(qm), w.qweight)
    for dtype in (torch.float16, torch.bfloat16):
        want = w4a16_dequantize(w.qweight, w.scales, w.zeros, group_size=128, dtype=dtype)
        got = w4a16_mma_dequantize(qm, w.scales, w.zeros, group_size=128, dtype=dtype)
        assert torch.equal(got, want)
        part = w4a16_mma_dequantize(qm[1:3], w.scales[16:48], w.zeros[16:48], group_size=128,
                                    dtype=dtype)  # fmt: skip
        assert torch.equal(part, want[16:48])


def test_the_launch_defaults_follow_the_rows_and_the_grid() -> None:
    """Llama-3.1-8B's projections on 132 SMs (qkv 384 tiles, o and down 256, gate_up 1,792):
    up to 16 rows of x as many warps a tile as keep the grid within 64 warps an SM (8, and 4
    for gate_up); 32 rows within 16 an SM, at least 2; 64 rows within 8, at least 2 and at
    most 4. Never more than the groups allow. Zero points inside A but for 2 tiles of x in a
    grid of fewer than 20 warps an SM; 4 chunks ahead for 8 tiles of x, else 2."""
    qkv, o, gate_up, down = (6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)
    want = {1: (8, 8, 4, 8), 16: (8, 8, 4, 8), 32: (4, 8, 2, 8), 64: (2, 4, 2, 4)}
    for m, splits in want.items():
        got = tuple(mma_split(k, 128, n, 132, m) for n, k in (qkv, o, gate_up, down))
        assert got == splits, m
    assert mma_split(256, 128, 4096, 132) == 2  # two groups: two warps
    assert mma_split(128, 128, 28672, 132, m=64) == 1  # one group: one warp, whatever the rule
    assert [zsub_default(m, 4096, 8, 132) for m in (1, 9, 16, 17, 33)] == [
        True, False, False, True, True
    ]  # fmt: skip
    assert zsub_default(16, 6144, 8, 132)  # 384 tiles x 8 warps: 23 an SM
    assert [mma_ahead(m) for m in (1, 8, 32, 33, 64)] == [2, 2, 2, 4, 4]
    assert split_at_most(4096, 128, 8) == 8
    assert split_at_most(384, 128, 8) == 1  # three groups
    assert split_at_most(64, 64, 4) == 1


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("rows", "1 to 64 rows"),
        ("fp32", "must be one of bfloat16, float16"),
        ("group", "groups of at least 32"),
        ("both", "zero points \\(zeros\\) or mins, not both"),
        ("zsub-mins", "zsub takes integer zero points"),
        ("misaligned", "16-byte aligned"),
        ("split", "split must be a power of two"),
        ("ahead", "ahead must be 1 to 16 chunks"),
        ("x_ahead", "x_ahead must be 0 to 4 chunks"),
        ("qmma", "qmma must have shape"),
        ("n", "zeros must have shape"),
    ],
)
def test_bad_arguments_are_refused_with_the_reason(case: str, message: str) -> None:
    gen = torch.Generator().manual_seed(0)
    w = W4(32, 256, 64 if case == "group" else 128, gen)
    qm = shuffle_w4(w.qweight)
    x = torch.randn(65 if case == "rows" else 2, 256, generator=gen).to(DEVICE, torch.bfloat16)
    group, split, ahead, x_ahead = (16 if case == "group" else w.group_size), None, 2, None
    mins: torch.Tensor | None = None
    zsub: bool | None = None
    scales = w.scales
    zeros: torch.Tensor | None = w.zeros
    if case == "fp32":
        x = x.float()
    elif case == "misaligned":
        x = torch.randn(2, 260, generator=gen).to(DEVICE, torch.bfloat16)[:, 2:258]
    elif case == "split":
        split = 3
    elif case == "ahead":
        ahead = 17
    elif case == "x_ahead":
        x_ahead = 5
    elif case == "qmma":
        qm = qm[:, :2]
    elif case == "n":
        zeros = w.zeros[:16]
    elif case == "both":
        mins = w.scales
    elif case == "zsub-mins":
        zeros, mins, zsub = None, w.scales, True
    if case == "group":
        scales = torch.cat([w.scales] * 4, dim=1)
        zeros = torch.cat([w.zeros] * 4, dim=1)
    with pytest.raises((ValueError, TypeError), match=message):
        w4a16_mma(x, qm, scales, zeros, group_size=group, split=split, ahead=ahead,
                  x_ahead=x_ahead, mins=mins, zsub=zsub)  # fmt: skip
