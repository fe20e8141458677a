"""int4's 16-bit scale words: the small floats they hold, per-element error bounds, and the cost of
squeezing float32 scale + offset pairs into one word (relative RMSE against a float32-pair reference)."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import as_pages, gaussian_kv

from kvstrata.quant import get_codec, relative_rmse
from kvstrata.quant.int4 import KEY_SCALE, UNIT_STEPS, VALUE_SCALE, scale_offset
from kvstrata.quant.minifloat import MiniFloat

INT4 = get_codec("int4")


@pytest.mark.parametrize("fmt", [KEY_SCALE, VALUE_SCALE])
def test_minifloat_codes_round_trip_and_encode_to_the_nearest(fmt: MiniFloat):
    codes = torch.arange(1 << fmt.bits, dtype=torch.int32)
    values = fmt.decode(codes)
    assert values[0] == 0 and values[-1] == fmt.max
    assert (values[1:] > values[:-1]).all()  # monotonic: no duplicate or NaN code
    assert torch.equal(fmt.encode(values), codes)
    g = torch.Generator().manual_seed(0)
    subnormal = torch.rand(1000, generator=g) * 2.0**fmt.emin
    r = torch.cat((torch.rand(4000, generator=g) * fmt.max * 1.2, subnormal))
    got = fmt.decode(fmt.encode(r))
    nearest = (values[None, :] - r.clamp(max=fmt.max)[:, None]).abs().min(1).values
    assert torch.equal((got - r.clamp(max=fmt.max)).abs(), nearest)
    # normal binades keep mantissa_bits bits: relative rounding error at most 2**-(bits + 1)
    normal = (r >= 2.0**fmt.emin) & (r <= fmt.max)
    assert ((got - r).abs() <= r * 2.0 ** -(fmt.mantissa_bits + 1))[normal].all()


def test_minifloat_formats():
    assert (KEY_SCALE.bits, VALUE_SCALE.bits) == (8, 10)  # a key word keeps a byte for its zero point
    assert KEY_SCALE.max >= (2 * UNIT_STEPS + 1.5) / 15  # any channel's scale in units fits


def test_key_error_is_within_half_a_step_or_half_a_unit():
    """Keys (a page's channels): each element decodes within half its channel's step, or, at the
    channel's min, within half the page-head unit (the offset is the min to the nearest unit)."""
    x = as_pages(gaussian_kv(seed=1, tokens=64)) + torch.randn(1, 1, 4, 128) * 8  # channel offsets
    q = INT4.quantize(x, "channel")
    scale, offset = scale_offset(q.parts["scale"], "channel", 128)
    unit = x.abs().amax(dim=(-3, -1), keepdim=True) / UNIT_STEPS * (1 + 2**-8)
    err = (INT4.dequantize(q) - x).abs()
    assert (err <= torch.maximum(scale * 0.5 * (1 + 2**-5), unit * 0.5)).all()
    assert (offset - x.amin(-3, keepdim=True)).abs().le(unit * 0.5).all()


def test_value_error_is_within_half_a_step():
    x = gaussian_kv(seed=2)
    x[::3] += 5.0  # tokens whose range sits away from 0: widened to include it
    q = INT4.quantize(x, "token")
    scale, offset = scale_offset(q.parts["scale"], "token", 128)
    assert (offset <= 0).all() and (offset + 15 * scale >= 0).all()  # the grid includes 0
    # the scale to 5 mantissa bits may shorten the grid by 15 * 2**-6 steps; the zero point is exact to 1/8
    err = (INT4.dequantize(q) - x).abs()
    assert (err <= scale * (0.5 + 15 * 2**-6 + 0.125)).all()


def float32_pairs(x: torch.Tensor, dim: int) -> torch.Tensor:
    """The layout before the 16-bit words: float32 scale (max - min) / 15 and offset min per group."""
    lo, hi = x.amin(dim, keepdim=True), x.amax(dim, keepdim=True)
    scale = (hi - lo) / 15
    codes = torch.round((x - lo) / torch.where(scale > 0, scale, 1.0)).clamp(0, 15)
    return codes * scale + lo


@pytest.mark.parametrize("granularity", ["token", "channel"])
def test_words_cost_little_against_float32_pairs(granularity: str):
    """Measured (seed 0): keys 0.0766 vs 0.0763 with float32 pairs, values 0.0997 vs 0.0996."""
    x = as_pages(gaussian_kv(seed=0))
    dim = -3 if granularity == "channel" else -1
    words = relative_rmse(x, INT4.dequantize(INT4.quantize(x, granularity)))
    pairs = relative_rmse(x, float32_pairs(x, dim))
    assert pairs <= words <= pairs * 1.02
