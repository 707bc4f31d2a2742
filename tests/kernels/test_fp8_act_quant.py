"""quantize_act against its torch twin: per token, per 128 columns, a static scale; q bit for
bit (the kernel rounds to the e4m3 grid itself, so its cast is exact even in the interpreter,
whose own fp32 -> fp8 cast drops the carry into the next power of two)."""

from __future__ import annotations

import pytest
import torch

from kernels.fp8_act_quant import quantize_act, quantize_act_ref
from kernels.fp8_weights import FP8
from tests.kernels.helpers import ALL_DTYPES, DEVICE, randn


def assert_same(
    got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]
) -> None:
    assert got[0].dtype == FP8
    assert torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
    torch.testing.assert_close(got[1], want[1], atol=0.0, rtol=1e-6)


@pytest.mark.parametrize("dtype", ALL_DTYPES)
@pytest.mark.parametrize("group", [0, 128])
@pytest.mark.parametrize(("m", "k"), [(1, 64), (5, 300), (3, 1100)])
def test_matches_reference(m: int, k: int, group: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(m * 100 + k + group)
    x = randn(m, k, dtype=dtype, gen=gen, scale=3.0)
    x[0, : min(k, 128)] = 0.0  # an all-zero group: a tiny scale, zeros out
    got = quantize_act(x, group=group)
    assert got[1].shape == (m, 1 if group == 0 else -(-k // 128))
    assert_same(got, quantize_act_ref(x, group=group))


def test_values_round_to_nearest_across_a_power_of_two() -> None:
    """126.6 is nearer 128 than 120; subnormals are multiples of 2^-9. The row's max, 448,
    sets the scale to 1."""
    x = torch.tensor([[448.0, 126.6, -126.6, 31.9, 0.0015, 0.0009, -300.0]], device=DEVICE)
    q, scale = quantize_act(x)
    assert scale.item() == 1.0
    assert q.float().tolist() == [[448.0, 128.0, -128.0, 32.0, 2**-9, 0.0, -288.0]]


def test_static_scale_saturates_outliers() -> None:
    gen = torch.Generator().manual_seed(3)
    x = randn(4, 200, dtype=torch.bfloat16, gen=gen, scale=5.0)
    static = torch.tensor([0.005], device=DEVICE)  # 448 * 0.005 = 2.24: larger |x| clamp
    got = quantize_act(x, static_scale=static)
    assert_same(got, quantize_act_ref(x, static_scale=static))
    assert got[0].float().abs().max().item() == 448.0
    assert torch.equal(got[1], static.expand(4, 1))


def test_strided_rows() -> None:
    gen = torch.Generator().manual_seed(4)
    x = randn(3, 400, dtype=torch.float32, gen=gen)[:, :256]
    assert_same(quantize_act(x, group=128), quantize_act_ref(x, group=128))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"group": -1}, "group must be 0"),
        ({"group": 128, "static_scale": torch.ones(1)}, "a static scale is per token"),
        ({"static_scale": torch.ones(2)}, r"static_scale must have shape \[1\]"),
    ],
)
def test_rejects_bad_arguments(kwargs: dict[str, object], match: str) -> None:
    kw = {k: v.to(DEVICE) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        quantize_act(torch.zeros(2, 64, device=DEVICE), **kw)  # type: ignore[arg-type]
