"""Static scales: clipping, exact overflow counts, scales taken from the clip rather than the data."""

from __future__ import annotations

import pytest
import torch

from kvstrata.quant import get_codec, list_codecs
from kvstrata.quant.int4 import scale_offset

SCALED = [n for n in list_codecs() if n not in ("bf16", "fp32")]


def constructed() -> tuple[torch.Tensor, torch.Tensor, int]:
    """[16 tokens, 2 heads, 32] in [-0.9, 0.9] with known elements beyond a per-head clip of (1, 2)."""
    x = torch.linspace(-0.9, 0.9, 16 * 2 * 32).view(16, 2, 32)
    clip = torch.tensor([[1.0], [2.0]])
    x[0, 0, :5] = 1.5  # 5 over head 0's clip
    x[3, 0, 0] = -1.0  # exactly at the clip: not counted
    x[7, 1, 2] = -2.5  # 1 over head 1's clip
    x[9, 1, 4:7] = 1.5  # under head 1's clip
    x[11, 0, 8] = float("nan")  # non-finite: counted separately, never as overflow
    return x, clip, 6


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("name", SCALED)
def test_overflow_count_is_exact(name: str, granularity: str):
    x, clip, expected = constructed()
    q = get_codec(name).quantize(x, granularity, static_absmax=clip)
    assert q.overflow == expected
    assert q.nonfinite == 1
    assert get_codec(name).quantize(x, granularity).overflow == 0  # dynamic scales never clip


@pytest.mark.parametrize("name", SCALED)
def test_clipped_values_decode_to_the_clip(name: str):
    x, clip, _ = constructed()
    y = get_codec(name).dequantize(get_codec(name).quantize(x, "token", static_absmax=clip))
    # int8_asym's 255 steps put -clip and +clip on the grid; fp4's BF16 global scale may clip by 2^-8;
    # int4's 5-bit scale mantissa and quarter-step zero point leave the clip within half a step
    rtol = {"fp4_e2m1": 2**-8, "int4": 1 / 15 * (1 + 2**-6)}.get(name, 1e-6)
    assert torch.allclose(y[0, 0, :5], torch.ones(5), rtol=rtol)
    assert torch.allclose(y[7, 1, 2], torch.tensor(-2.0), rtol=rtol)


@pytest.mark.parametrize("name", ["int8", "int8_asym", "int4"])
def test_scale_comes_from_the_clip(name: str):
    x = torch.full((4, 2, 32), 0.01)
    clip = torch.tensor([[1.0], [2.0]])
    q = get_codec(name).quantize(x, "token", static_absmax=clip)
    scale = q.parts["scale"]
    assert scale.shape == (4, 2, 1)
    qmax = {"int8": 127, "int8_asym": 255 / 2, "int4": 15 / 2}[name]
    if name == "int4":  # a 16-bit word: the scale to 5 mantissa bits, the offset -clip to a quarter step
        scale, offset = scale_offset(scale, "token", 32)
        assert torch.allclose(offset, -clip.expand(4, 2, 1), rtol=0, atol=float(scale.max()) / 8)
        assert torch.allclose(scale, (clip / qmax).expand(4, 2, 1), rtol=2**-6)
        return
    assert torch.allclose(scale, (clip / qmax).expand(4, 2, 1))


def test_fp8_scale_is_the_clip_rounded_up_to_a_power_of_two():
    x = torch.full((4, 2, 32), 0.01)
    q = get_codec("fp8_e4m3").quantize(x, "token", static_absmax=torch.tensor([[1.0], [2.0]]))
    # 1 / 448 -> 2^-8 (1/256), 2 / 448 -> 2^-7; stored as the biased exponent
    assert torch.equal(q.parts["scale_exp"][0, :, 0], torch.tensor([127 - 8, 127 - 7], dtype=torch.uint8))


def test_fp4_global_scale_comes_from_the_clip():
    x = torch.full((16, 2, 32), 0.01)
    q = get_codec("fp4_e2m1").quantize(x, "token", static_absmax=torch.tensor([[1.0], [2.0]]))
    expected = (torch.tensor([1.0, 2.0]) / (6 * 448)).to(torch.bfloat16)
    assert torch.equal(q.parts["global_scale"][0, :, 0], expected)


@pytest.mark.parametrize("name", SCALED)
def test_per_channel_clip(name: str):
    """A [heads, head_dim] clip works with both granularities and clips per channel."""
    x = torch.ones(16, 2, 32)
    clip = torch.ones(2, 32)
    clip[1, :4] = 0.5  # four channels of head 1 clip every one of their 16 tokens
    for granularity in ("token", "channel"):
        q = get_codec(name).quantize(x, granularity, static_absmax=clip)
        assert q.overflow == 4 * 16
        y = get_codec(name).dequantize(q)
        # int4 per token: 0.5 on the grid of the token's range [-1, 1], within half a step (1/15)
        rtol = 0.14 if name == "int4" and granularity == "token" else 0.07
        assert torch.allclose(y[:, 1, :4], torch.full((16, 4), 0.5), rtol=rtol)


def test_bad_static_absmax():
    codec = get_codec("int8")
    with pytest.raises(ValueError, match="does not broadcast"):
        codec.quantize(torch.ones(4, 2, 32), static_absmax=torch.ones(3, 1))
    with pytest.raises(ValueError, match="finite and >= 0"):
        codec.quantize(torch.ones(4, 2, 32), static_absmax=torch.tensor([[-1.0], [1.0]]))


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_raw_codecs_ignore_static_absmax(name: str):
    x = torch.full((2, 2, 4), 3.0)
    q = get_codec(name).quantize(x, static_absmax=torch.ones(2, 1))
    assert q.overflow == 0 and torch.equal(get_codec(name).dequantize(q), x)
