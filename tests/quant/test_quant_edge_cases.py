"""Edge cases: zeros, constants, outliers, awkward shapes, empty and integer inputs, NaN/Inf."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import gaussian_kv

from kvstrata.quant import get_codec, list_codecs, relative_rmse

SCALED = [n for n in list_codecs() if n not in ("bf16", "fp32")]
ASYMMETRIC = ("int4", "int8_asym")


def round_trip(name: str, x: torch.Tensor, granularity: str = "token") -> torch.Tensor:
    codec = get_codec(name)
    return codec.dequantize(codec.quantize(x, granularity))


@pytest.mark.parametrize("name", list_codecs())
def test_zero_tokens_decode_to_exact_zeros(name: str):
    x = gaussian_kv(tokens=32, heads=2, head_dim=64)
    x[[3, 17, 30]] = 0.0
    y = round_trip(name, x)
    assert torch.equal(y[[3, 17, 30]], torch.zeros(3, 2, 64))
    assert torch.equal(round_trip(name, torch.zeros(2, 16, 2, 64), "channel"), torch.zeros(2, 16, 2, 64))


@pytest.mark.parametrize("name", list_codecs())
def test_constant_tokens_and_channels(name: str):
    values = torch.tensor([1.5, -3.25, 0.125, 96.0])  # exact in bf16
    tokens = values.view(4, 1, 1).expand(4, 2, 32).contiguous()
    # fp8's power-of-two scale keeps values as they are: -3.25 needs 3 mantissa bits, E5M2 has 2
    rtol = 2**-3 if name == "fp8_e5m2" else 1e-6
    # fp4: the BF16 global scale may clip the group's absmax by up to 2^-8
    token_rtol = 2**-8 if name == "fp4_e2m1" else rtol
    # int4 values: the token's range widens to include 0 and its scale keeps 5 mantissa bits, so a
    # constant decodes within 2^-6 (scale) + 1/120 (the zero point's quarter step over 15 steps)
    token_rtol = 2**-5 if name == "int4" else token_rtol
    assert torch.allclose(round_trip(name, tokens), tokens, rtol=token_rtol, atol=0)
    channels = values.repeat(16).view(1, 2, 32).expand(16, 2, 32).contiguous()  # constant over tokens
    # fp4: the E4M3 block scale of a channel below the page-head absmax is rounded (step 2^-3)
    rtol = 2**-4 if name == "fp4_e2m1" else rtol
    # int4 keys: a channel's offset is its min to the nearest multiple of the page-head unit absmax/127
    atol = 96.0 / 127 / 2 * (1 + 2**-8) if name == "int4" else 0.0
    assert torch.allclose(round_trip(name, channels, "channel"), channels, rtol=rtol, atol=atol)


@pytest.mark.parametrize("name", SCALED)
def test_huge_outlier_stays_in_its_scale_group(name: str):
    x = gaussian_kv(tokens=32, heads=2, head_dim=64)
    spiked = x.clone()
    spiked[5, 1, 7] = 1e4
    codec = get_codec(name)
    # token scales: every other token and head decodes bit-identically
    y, y_spiked = round_trip(name, x), round_trip(name, spiked)
    keep = torch.ones(32, 2, dtype=torch.bool)
    keep[5, 1] = False
    assert torch.equal(y[keep], y_spiked[keep])
    assert abs(y_spiked[5, 1, 7].item() - 1e4) <= 1e4 * 0.07  # the outlier itself survives (e5m2: 2^-3 step)
    # channel scales: only that channel of that head in that page is affected
    pages, pages_spiked = x.view(2, 16, 2, 64), spiked.view(2, 16, 2, 64)
    c, c_spiked = (
        codec.dequantize(codec.quantize(pages, "channel")),
        codec.dequantize(codec.quantize(pages_spiked, "channel")),
    )
    assert torch.equal(c[1], c_spiked[1])
    affected = torch.zeros(2, 16, 2, 64, dtype=torch.bool)
    if name.startswith("fp8"):  # one exponent per page and head: the head's other channels keep
        affected[0, :, 1] = True  # their relative precision, down to an absolute floor of absmax * 2**-17
        bound = pages_spiked.abs() * 2**-3 + 1e4 * 2**-17
        assert ((c_spiked - pages_spiked).abs() <= bound)[affected].all()
    elif name == "int4":  # offsets are multiples of a page-head unit absmax/127: the head's other
        affected[0, :, 1] = True  # channels' mins may clip by half a unit, their steps grow by one
        assert ((c_spiked - pages_spiked).abs() <= 1e4 / 127)[affected].all()
    else:
        affected[0, :, 1, 7] = True
    if name != "fp4_e2m1":  # fp4's per page-head global scale couples all channels of the head
        assert torch.equal(c[~affected], c_spiked[~affected])
    assert torch.equal(c[0, :, 0], c_spiked[0, :, 0])


def test_block_size_errors_are_clear():
    fp4, int4 = get_codec("fp4_e2m1"), get_codec("int4")
    with pytest.raises(ValueError, match="head_dim=48 is not a multiple of 32"):
        fp4.quantize(torch.randn(4, 2, 48))
    with pytest.raises(ValueError, match="head_dim=48 is not a multiple of 32"):
        fp4.page_parts(16, 2, 48, "token")
    with pytest.raises(ValueError, match=r"tokens axis \(8\) must be a multiple of 16"):
        fp4.quantize(torch.randn(8, 2, 32), "channel")
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        int4.quantize(torch.randn(4, 2, 7))
    with pytest.raises(ValueError, match="head_dim=7 is odd"):
        int4.page_parts(16, 2, 7, "channel")


@pytest.mark.parametrize("name", [n for n in list_codecs() if n not in ("int4", "fp4_e2m1")])
def test_any_head_dim_for_byte_codecs(name: str):
    x = torch.linspace(-1, 1, 4 * 3 * 7).view(4, 3, 7)
    q = get_codec(name).quantize(x)
    assert q.nbytes() == 4 * get_codec(name).bytes_per_token(3, 7)
    assert relative_rmse(x, get_codec(name).dequantize(q)) < 0.06


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("name", list_codecs())
def test_empty_tensors(name: str, granularity: str):
    codec = get_codec(name)
    for shape in [(0, 2, 32), (0, 16, 2, 32)]:
        q = codec.quantize(torch.empty(shape), granularity)
        y = codec.dequantize(q)
        assert y.shape == shape
        assert q.overflow == 0 and q.nonfinite == 0
    q = codec.quantize(torch.empty(0, 2, 32), granularity, static_absmax=torch.ones(2, 1))
    assert codec.dequantize(q).shape == (0, 2, 32)


@pytest.mark.parametrize("name", list_codecs())
def test_integer_and_malformed_inputs_are_rejected(name: str):
    codec = get_codec(name)
    with pytest.raises(TypeError, match="floating-point tensor, got dtype torch.int32"):
        codec.quantize(torch.ones(4, 2, 32, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"expected \[..., tokens, heads, head_dim\]"):
        codec.quantize(torch.ones(2, 32))


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("name", SCALED)
def test_nonfinite_counted_decoded_as_zero_neighbours_unaffected(name: str, granularity: str):
    x = gaussian_kv(tokens=32, heads=2, head_dim=64)
    bad = x.clone()
    bad[4, 0, 3], bad[4, 0, 9], bad[20, 1, 0] = float("nan"), float("inf"), float("-inf")
    cleaned = bad.nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    codec = get_codec(name)
    q = codec.quantize(bad, granularity)
    assert q.nonfinite == 3 and q.overflow == 0
    y = codec.dequantize(q)
    assert torch.isfinite(y).all()
    at_bad = torch.stack([y[4, 0, 3], y[4, 0, 9], y[20, 1, 0]])
    if name in ASYMMETRIC:  # 0 is not on a min/max grid: the nearest grid point, within half a step
        half_step = q.parts["scale"].max() / 2
        assert (at_bad.abs() <= half_step * (1 + 1e-6)).all()
    else:
        assert torch.equal(at_bad, torch.zeros(3))
    # exactly as if the bad elements had been zeros: no scale saw them
    assert torch.equal(y, codec.dequantize(codec.quantize(cleaned, granularity)))
    # token scales: other tokens decode exactly as without the bad elements
    if granularity == "token":
        clean_y = codec.dequantize(codec.quantize(x, granularity))
        assert torch.equal(y[[0, 1, 2, 3, 5, 31]], clean_y[[0, 1, 2, 3, 5, 31]])


@pytest.mark.parametrize("name", ["bf16", "fp32"])
def test_raw_codecs_pass_nonfinite_through(name: str):
    x = torch.tensor([[[1.0, float("nan"), float("inf"), -2.0]]])
    q = get_codec(name).quantize(x)
    assert q.nonfinite == 2
    y = get_codec(name).dequantize(q)
    assert y[0, 0, 0] == 1.0 and y[0, 0, 1].isnan() and y[0, 0, 2] == float("inf")
