"""Codecs against references that do not come from the codecs: torch's own float8 casts with a
power-of-two scale chosen by hand (fp8), and the OCP E2M1 value table written out here (fp4)."""

from __future__ import annotations

import math

import pytest
import torch

from kvstrata.quant import get_codec
from kvstrata.quant.nibbles import unpack

# OCP Microscaling spec, E2M1: 1 sign, 2 exponent (bias 1), 1 mantissa bit; code = sign << 3 | magnitude.
E2M1 = {
    0b000: 0.0,
    0b001: 0.5,  # subnormal: 0.1b x 2^0
    0b010: 1.0,
    0b011: 1.5,
    0b100: 2.0,
    0b101: 3.0,
    0b110: 4.0,
    0b111: 6.0,
}


def hand_exponent(absmax: float, fmax: float) -> int:
    """Smallest integer e with absmax / 2**e <= fmax (0 for an all-zero group)."""
    if absmax == 0:
        return 0
    e = math.floor(math.log2(absmax / fmax)) - 1
    while absmax / 2.0**e > fmax:
        e += 1
    return e


@pytest.mark.parametrize(
    ("name", "dtype", "fmax"),
    [("fp8_e4m3", torch.float8_e4m3fn, 448.0), ("fp8_e5m2", torch.float8_e5m2, 57344.0)],
)
def test_fp8_codes_are_torch_float8_casts_of_x_over_a_power_of_two(name, dtype, fmax):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 2, 32, generator=g) * torch.logspace(-3, 3, 16).view(16, 1, 1)
    x[3, 1] = 0.0  # an all-zero group
    q = get_codec(name).quantize(x, "token")
    codes, scale_exp = q.parts["codes"], q.parts["scale_exp"]
    for t in range(16):
        for h in range(2):
            group = x[t, h]
            e = hand_exponent(float(group.abs().max()), fmax)
            assert int(scale_exp[t, h, 0]) == e + 127, (t, h)
            expected = (group / 2.0**e).to(dtype)  # exact power-of-two scaling, then torch's cast
            assert torch.equal(codes[t, h].view(torch.uint8), expected.view(torch.uint8)), (t, h)
            decoded = get_codec(name).dequantize(q)[t, h]
            assert torch.equal(decoded, expected.float() * 2.0**e)


def test_fp8_e4m3_rounds_as_the_format_does():
    """A few hand-checked E4M3 values (3 mantissa bits: spacing 1/8 in [1, 2), 32 in [256, 448])."""
    x = torch.tensor([1.0, 1.0625, 1.1875, 300.0, 448.0, -0.01171875, 0.0] + [0.0] * 9).view(1, 1, 16)
    codec = get_codec("fp8_e4m3")
    q = codec.quantize(x, "token")  # one group, absmax 448: the scale is 2**0
    assert int(q.parts["scale_exp"].flatten()[0]) == 127
    out = codec.dequantize(q).flatten()
    # 1.0625 is halfway between 1 and 1.125: ties to even -> 1.0; 1.1875 -> 1.25 (even); 300 -> 288;
    # -0.01171875 = -0.75 * 2**-6 is a subnormal (0.110b x 2**-6): exact
    assert out[:7].tolist() == [1.0, 1.0, 1.25, 288.0, 448.0, -0.01171875, 0.0]


def test_fp4_decodes_to_the_nearest_e2m1_value_with_the_documented_code_layout():
    """With 5.25 = 6 * 0.875 in every block and every scale group, the global scale is 5.25 / 2688 =
    2**-9 (exact in BF16) and every block scale 448 (exact in E4M3): the scale is exactly 0.875, so
    codes are plain E2M1 of x / 0.875 and decode to the nearest table value times 0.875 (values at
    midpoints are avoided)."""
    table = torch.tensor([E2M1[c & 7] * (-1.0 if c & 8 else 1.0) for c in range(16)])
    mids = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    g = torch.Generator().manual_seed(1)
    x = (torch.rand(16, 2, 32, generator=g) * 12 - 6).clamp(-5.99, 5.99)
    x = torch.where((x.abs().unsqueeze(-1) - mids).abs().amin(-1) < 1e-3, x + 0.01, x)
    x[0] = 6.0  # every 16-token block (channel granularity) has a 6
    x[..., ::16] = -6.0  # every 32-channel block (token granularity) too
    codec = get_codec("fp4_e2m1")
    for granularity in ("token", "channel"):
        q = codec.quantize(x * 0.875, granularity)
        codes = unpack(q.parts["codes"])  # pairs of elements: low nibble first
        nearest = (x.unsqueeze(-1) - table).abs().argmin(-1)  # the index of the nearest table value
        assert torch.equal(table[codes], table[nearest]), granularity
        assert torch.equal(codec.dequantize(q), table[nearest] * 0.875), granularity
        first_byte = int(q.parts["codes"][1, 0, 0])
        assert first_byte == int(codes[1, 0, 0]) | int(codes[1, 0, 1]) << 4
