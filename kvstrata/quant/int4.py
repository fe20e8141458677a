"""`int4`: asymmetric (min/max) 4-bit integers, two codes per byte, with one 16-bit scale word per group.

Decoding is ``code * scale + offset`` with code in ``[0, 15]`` (`nibbles` packs them). Each scale group
(a channel of a page's keys, a token of values) keeps its scale and offset in one int16 word, so a
16-token page of one head costs 2,338 bytes of K and V at head_dim 128 (codes 2,048), 3.50x less than
BF16; float32 scale and offset pairs cost 3,200 (2.56x).

Keys (channel granularity), per page: ``codes`` ``[P, H, D/2]`` uint8 and ``scale`` ``[1, H, D + 1]``
int16. Word ``D`` holds the bits of the page-head's BF16 unit ``u = bf16(absmax / 127)``; word ``c < D``
holds channel ``c``'s scale code (low byte, `KEY_SCALE`: an unsigned E3M5 float in units of ``u``)
and its zero point ``z`` (high byte, int8): ``offset = z * u`` (the channel's min rounded to the
nearest multiple of ``u``), ``scale = KEY_SCALE(code) * u`` (``(max - offset) / 15`` to nearest).
A per-channel offset must be able to sit far from 0 (keys carry channels with large means), hence the
page-wide unit; E3M5 keeps 5 mantissa bits where E4M3 keeps 3 (relative RMSE of real keys 0.0328
against 0.0345 with E4M3 scales, 0.0325 with float32 pairs: docs/quant.md).

Values (token granularity), per page: ``codes`` ``[P, H, D/2]`` and ``scale`` ``[P, H, 1]`` int16:
low 10 bits the scale's code (`VALUE_SCALE`: unsigned E5M5, FP16's exponent range, absolute), high 6
bits a zero point ``z`` in quarter steps: ``offset = -z * scale / 4``. The token's range is widened to
include 0 (a token's 128 channels practically always straddle it), so ``z`` in ``[0, 63]`` always
reaches its min; no unit is needed, and a per-token word is all a kernel loads.

Every value above is exact in float32 (products of short integers and powers of two), so torch on
CPU or CUDA and the Triton twins (`kernel_encode`, `kernel_decode`) compute the same codes.
"""

from __future__ import annotations

import torch

from kvstrata.quant.affine import affine_codes, div, min_max, safe_divisor
from kvstrata.quant.codec import PartSpec, ScaledCodec, check_granularity
from kvstrata.quant.minifloat import MiniFloat
from kvstrata.quant.nibbles import check_even, pack, unpack
from kvstrata.quant.prepare import Prepared
from kvstrata.quant.registry import register

LEVELS = 15
UNIT_STEPS = 127  # a key unit is absmax / 127: int8 zero points reach any channel's min
# Key scales in units: at most about (2 * 127 + 1) / 15 = 17, so the top binade is [16, 32).
KEY_SCALE = MiniFloat(mantissa_bits=5, emin=-2, emax=4)
VALUE_SCALE = MiniFloat(mantissa_bits=5, emin=-14, emax=16)  # FP16's binades, 5 mantissa bits
ZERO_STEPS = 4  # value zero points count quarter scale steps
ZERO_MAX = 63  # 6 bits


def as_int16(words: torch.Tensor) -> torch.Tensor:
    """int32 words in ``[0, 2**16)`` or ``[-2**15, 2**15)`` as int16 with the same low 16 bits."""
    return (((words + 32768) & 0xFFFF) - 32768).to(torch.int16)


def key_words(scale_code: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return as_int16(scale_code | (zero.to(torch.int32) << 8))


def value_words(scale_code: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    return as_int16(scale_code | (zero.to(torch.int32) << VALUE_SCALE.bits))


class Int4Codec(ScaledCodec):
    name = "int4"

    def _check_geometry(self, tokens: int, head_dim: int, granularity: str) -> None:
        check_even(head_dim, self.name)

    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        lo, hi = min_max(p, granularity)
        if granularity == "channel":
            unit = div(torch.maximum(-lo, hi).amax(-1, keepdim=True), UNIT_STEPS).to(torch.bfloat16)
            u = unit.to(torch.float32)
            su = safe_divisor(u)
            zero = torch.round(lo / su).clamp_(-128, 127)
            offset = zero * u
            code = KEY_SCALE.encode(div(hi - offset, LEVELS) / su)
            scale = KEY_SCALE.decode(code) * u
            words = torch.cat((key_words(code, zero), unit.view(torch.int16)), dim=-1)
        else:
            lo, hi = lo.clamp(max=0.0), hi.clamp(min=0.0)
            code = VALUE_SCALE.encode(div(hi - lo, LEVELS))
            scale = VALUE_SCALE.decode(code)
            zero = torch.round(-lo / safe_divisor(scale) * ZERO_STEPS).clamp_(0, ZERO_MAX)
            offset = -(zero * scale) * (1.0 / ZERO_STEPS)
            words = value_words(code, zero)
        return {"codes": pack(affine_codes(p.x, scale, offset, LEVELS)), "scale": words}

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        scale, offset = scale_offset(parts["scale"], granularity, head_dim)
        return (unpack(parts["codes"]).to(torch.float32) * scale + offset).to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        check_granularity(granularity)
        check_even(head_dim, self.name)
        words = (1, heads, head_dim + 1) if granularity == "channel" else (page_size, heads, 1)
        return {"codes": ((page_size, heads, head_dim // 2), torch.uint8), "scale": (words, torch.int16)}


def scale_offset(words: torch.Tensor, granularity: str, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 ``(scale, offset)`` of int16 scale words, shaped ``[..., 1, H, D]`` (keys) or
    ``[..., T, H, 1]`` (values)."""
    if granularity == "channel":
        w = words[..., :head_dim].to(torch.int32)
        u = words[..., head_dim:].view(torch.bfloat16).to(torch.float32)
        return KEY_SCALE.decode(w & 0xFF) * u, (w >> 8).to(torch.float32) * u
    w = words.to(torch.int32) & 0xFFFF
    scale = VALUE_SCALE.decode(w & ((1 << VALUE_SCALE.bits) - 1))
    return scale, -((w >> VALUE_SCALE.bits).to(torch.float32) * scale) * (1.0 / ZERO_STEPS)


register(Int4Codec())
