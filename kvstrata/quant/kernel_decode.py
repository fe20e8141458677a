"""Triton device functions that decode a codec's page parts in registers (the attention kernels' view).

This is the kernel twin of each codec's ``dequantize_parts``: the same parts, laid out as the codec's
``page_parts`` says, decoded to float32 inside a kernel. The torch codecs stay the definition and the
reference; ``tests/radix/test_kernels_attend.py`` checks these functions against them for every codec
(through the attention kernels) and ``tests/radix/test_kernels_decode.py`` the 4-bit ones directly.

`kernel_format(codec)` gives the format id a kernel takes as a ``tl.constexpr`` and the order in which
it wants the codec's parts (at most three). FP8 parts travel as uint8 (``as_raw``) and are bit-cast
back in the kernel, so the same code runs on a GPU and under ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvstrata.quant import int4
from kvstrata.quant.codec import Codec

# Format ids: 0 raw values (bf16/fp32); 1/2 FP8 E4M3/E5M2 codes with an E8M0 scale exponent (per token,
# or per page and head for keys); 3 int8 codes * scale; 4 int8_asym codes * scale + offset; 5 int4
# (nibbles) codes * scale + offset from one int16 word per group (`int4_key_scale`, `int4_value_scale`);
# 6 E2M1 nibbles * E4M3 block scale (32 channels of a token, or 16 tokens of a channel) * BF16 global scale.
_FORMATS: dict[str, tuple[int, tuple[str, ...]]] = {
    "bf16": (0, ("values",)),
    "fp32": (0, ("values",)),
    "fp8_e4m3": (1, ("codes", "scale_exp")),
    "fp8_e5m2": (2, ("codes", "scale_exp")),
    "int8": (3, ("codes", "scale")),
    "int8_asym": (4, ("codes", "scale", "offset")),
    "int4": (5, ("codes", "scale")),
    "fp4_e2m1": (6, ("codes", "block_scale", "global_scale")),
}


# int4's scale words (`kvstrata.quant.int4`), as compile-time constants of the kernels.
INT4_KEY_M = tl.constexpr(int4.KEY_SCALE.mantissa_bits)
INT4_KEY_EMIN = tl.constexpr(int4.KEY_SCALE.emin)
INT4_VALUE_M = tl.constexpr(int4.VALUE_SCALE.mantissa_bits)
INT4_VALUE_EMIN = tl.constexpr(int4.VALUE_SCALE.emin)
INT4_VALUE_BITS = tl.constexpr(int4.VALUE_SCALE.bits)
INT4_VALUE_MASK = tl.constexpr((1 << int4.VALUE_SCALE.bits) - 1)
INT4_ZERO_STEP = tl.constexpr(1.0 / int4.ZERO_STEPS)
# A value scale code shifted under a float32 exponent reads as the scale over INT4_VALUE_F32_UNIT.
INT4_VALUE_F32_UNIT = tl.constexpr(2.0 ** (126 + int4.VALUE_SCALE.emin))
# A key scale code shifted under an FP16 exponent reads as the scale (in units) over INT4_KEY_F16_UNIT.
INT4_KEY_F16_SHIFT = tl.constexpr(10 - int4.KEY_SCALE.mantissa_bits)
INT4_KEY_F16_UNIT = tl.constexpr(2.0 ** (14 + int4.KEY_SCALE.emin))


def kernel_format(codec: Codec) -> tuple[int, tuple[str, ...]]:
    """``(format id, part names in kernel order)`` of ``codec``; ``ValueError`` if no kernel reads it."""
    try:
        return _FORMATS[codec.name]
    except KeyError:
        raise ValueError(f"no Triton kernel decodes codec {codec.name!r}") from None


@triton.jit
def fp8_value(c, E5M2: tl.constexpr):
    """uint8 bit patterns of FP8 values (E4M3FN or E5M2) as float32."""
    if E5M2:
        return c.to(tl.float8e5, bitcast=True).to(tl.float32)
    else:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)


# FP8 codes to FP16 pairs by PTX (sm_89+): four codes (one 32-bit register) to two registers of FP16
# pairs, the low byte pair first.
_FP8_F16_PTX = (
    "{{ .reg .b16 lo, hi; mov.b32 {{lo, hi}}, $2; cvt.rn.f16x2.{0}x2 $0, lo; cvt.rn.f16x2.{0}x2 $1, hi; }}"
)
E4M3_F16_ASM = tl.constexpr(_FP8_F16_PTX.format("e4m3"))
E5M2_F16_ASM = tl.constexpr(_FP8_F16_PTX.format("e5m2"))


@triton.jit
def fp8_f16(codes, E5M2: tl.constexpr):
    """uint8 FP8 codes (E4M3FN or E5M2) as FP16 (exact), by PTX: GPU only. The asm is declared impure
    so that Triton keeps the conversion where it is written, before a dot operand's layout change: the
    FP16 values then go through shared memory and load with ``ldmatrix`` (transposing for P.V's
    values). A plain FP8 conversion Triton moves past the change: value codes then load byte by byte,
    and key codes in 4-code groups that the query's operand must match, at a register move an element
    (Triton 3.6, sm_90; docs/kernels-h200.md, pass 9)."""
    if E5M2:
        x = tl.inline_asm_elementwise(E5M2_F16_ASM, "=r,=r,r", [codes], tl.float16, False, 4)
    else:
        x = tl.inline_asm_elementwise(E4M3_F16_ASM, "=r,=r,r", [codes], tl.float16, False, 4)
    return x


# Two 16-bit elements of FP8 code pairs (one 32-bit register: bytes e0, o0, e1, o1) to their even codes'
# FP16 pair (e0, e1) and their odd codes' (o0, o1): one byte permute, two conversions (sm_89+).
_FP8_PAIRS_PTX = (
    "{{ .reg .b32 t; .reg .b16 lo, hi; prmt.b32 t, $2, 0, 0x3120; mov.b32 {{lo, hi}}, t; "
    "cvt.rn.f16x2.{0}x2 $0, lo; cvt.rn.f16x2.{0}x2 $1, hi; }}"
)
E4M3_PAIRS_ASM = tl.constexpr(_FP8_PAIRS_PTX.format("e4m3"))
E5M2_PAIRS_ASM = tl.constexpr(_FP8_PAIRS_PTX.format("e5m2"))


@triton.jit
def fp8_pairs(pair, E5M2: tl.constexpr, ASM: tl.constexpr, OUT: tl.constexpr):
    """uint16 ``pair`` of FP8 codes (E4M3FN or E5M2; low byte an even channel, high byte the next odd
    one) as ``OUT`` ``(even, odd)``, exact. ``ASM``: `E4M3_PAIRS_ASM` / `E5M2_PAIRS_ASM` (FP16 ``OUT``,
    GPU only). Pure and 16 bits in, 16 bits out, so that Triton keeps the element's layout from the
    load to a dot operand: P.V's value operand then loads by a transposing ``ldmatrix`` of the 16-bit
    pairs (Triton 3.6, sm_90), not byte by byte as `fp8_value`'s 8-bit codes do there."""
    if ASM:
        if E5M2:
            even, odd = tl.inline_asm_elementwise(
                E5M2_PAIRS_ASM, "=r,=r,r", [pair], (tl.float16, tl.float16), True, 2
            )
        else:
            even, odd = tl.inline_asm_elementwise(
                E4M3_PAIRS_ASM, "=r,=r,r", [pair], (tl.float16, tl.float16), True, 2
            )
    else:
        even = fp8_value((pair & 255).to(tl.uint8), E5M2)
        odd = fp8_value((pair >> 8).to(tl.uint8), E5M2)
    return even.to(OUT), odd.to(OUT)


# Two 16-bit elements of int8 code pairs (one 32-bit register: bytes e0, o0, e1, o1) to their even codes'
# FP16 pair (e0, e1) and their odd codes' (o0, o1), exact: the sign bits flipped (x + 128), each byte
# placed under an FP16 exponent of 2**10 (1024 + x + 128, one byte permute a pair), then 1,152 taken
# off both lanes; five instructions for four codes, no integer-to-float conversion (a quarter-rate
# instruction on sm_90).
INT8_PAIRS_ASM = tl.constexpr(
    "{ .reg .b32 t, c; xor.b32 t, $2, 0x80808080; prmt.b32 $0, t, 0x64646464, 0x5240; "
    "prmt.b32 $1, t, 0x64646464, 0x5341; mov.b32 c, 0x64806480; sub.f16x2 $0, $0, c; sub.f16x2 $1, $1, c; }"
)


@triton.jit
def int8_pairs(pair, ASM: tl.constexpr, OUT: tl.constexpr):
    """uint16 ``pair`` of int8 codes (low byte an even channel, high byte the next odd one) as ``OUT``
    ``(even, odd)``, exact; `fp8_pairs`' twin for int8 history (``ASM``: `INT8_PAIRS_ASM`, FP16
    ``OUT``, GPU only)."""
    if ASM:
        even, odd = tl.inline_asm_elementwise(
            INT8_PAIRS_ASM, "=r,=r,r", [pair], (tl.float16, tl.float16), True, 2
        )
    else:
        even = (pair & 255).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
        odd = (pair >> 8).to(tl.uint8).to(tl.int8, bitcast=True).to(tl.float32)
    return even.to(OUT), odd.to(OUT)


F32_F16_ASM = tl.constexpr("cvt.rn.f16x2.f32 $0, $2, $1;")  # two float32 to an FP16 pair, the first low


@triton.jit
def f16_opaque(x):
    """float32 ``x`` as FP16 (round to nearest) by PTX: GPU only. Impure, like `fp8_f16`: Triton 3.6
    sizes a dot operand's register layout (``kWidth``) by the narrowest element type it finds walking
    back through pure element-wise operations, and the FP8 value scales' uint8 bytes among the softmax
    weights' inputs would give them (and the values) 8-bit operand layouts that take shuffles and
    register moves; the asm stops that walk at FP16."""
    return tl.inline_asm_elementwise(F32_F16_ASM, "=r,f,f", [x], tl.float16, False, 2)


@triton.jit
def pow2_scale(e):
    """The scale ``2 ** (e - 127)`` of a uint8 E8M0 exponent, built from its bits (no exp2)."""
    bits = e.to(tl.int32) << 23
    return tl.where(e == 0, 5.877471754111438e-39, bits.to(tl.float32, bitcast=True))


@triton.jit
def e2m1_value(c):
    """E2M1 codes (int32 nibbles, sign in bit 3) as float32: {0, .5, 1, 1.5, 2, 3, 4, 6} and negatives.

    Built from bits, with no int-to-float conversion (a quarter-rate instruction on the GPU): the code's
    sign goes to bit 15 and its exponent and mantissa bits to bits 9-11 of an FP16, which is then the
    value times 2**-14 exactly (code 1, 0.5, lands on an FP16 subnormal, which the conversion to
    float32 keeps)."""
    bits = ((c & 8) << 12) | ((c & 7) << 9)
    return bits.to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32) * 16384.0


@triton.jit
def nibble_value(c):
    """Integer codes 0..15 (int32) as float32 without an int-to-float conversion: placed in the
    mantissa of 2**23, then 2**23 subtracted (exact)."""
    return (c | 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0


@triton.jit
def minifloat_value(code, M: tl.constexpr, EMIN: tl.constexpr):
    """float32 value of int32 `MiniFloat` codes (``M`` mantissa bits, normal binades from ``2**EMIN``),
    built from bits as `MiniFloat.decode` does (exact)."""
    field = code >> M
    n = code - ((field - tl.minimum(field, 1)) << M)  # the mantissa with its implicit bit
    e = tl.maximum(field, 1) - 1 + EMIN - M
    return n.to(tl.float32) * ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def bf16_bits_value(bits):
    """float32 value of BF16 bits held in an int16."""
    return ((bits.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True)


@triton.jit
def int4_key_scale(word, unit):
    """int4 key ``(scale, offset)`` (float32) of int32 scale words (int16 loads: the zero point's sign
    extends) and their page-head unit."""
    scale = minifloat_value(word & 255, INT4_KEY_M, INT4_KEY_EMIN) * unit
    return scale, (word >> 8).to(tl.float32) * unit


@triton.jit
def int4_key_scale_codes(word):
    """int4 key ``(scale, zero point)`` in units of the page-head's unit (float32) of int32 scale
    words, the scale over ``INT4_KEY_F16_UNIT``: its code placed under an FP16 exponent (an E3M5
    code is an FP16 with a smaller exponent bias; its subnormals are FP16 subnormals), no minifloat
    arithmetic."""
    bits = ((word & 255) << INT4_KEY_F16_SHIFT).to(tl.int16)
    return bits.to(tl.float16, bitcast=True).to(tl.float32), (word >> 8).to(tl.float32)


@triton.jit
def int4_value_scale(word):
    """int4 value ``(scale, offset)`` (float32) of int32 scale words. The scale's code placed under a
    float32 exponent reads as the scale over ``INT4_VALUE_F32_UNIT`` (an E5M5 code is a float32
    with a smaller exponent bias; its subnormal codes are float32 subnormals), one exact multiply
    instead of `minifloat_value`'s arithmetic."""
    w = word & 0xFFFF
    bits = (w & INT4_VALUE_MASK) << (23 - INT4_VALUE_M)
    scale = bits.to(tl.float32, bitcast=True) * INT4_VALUE_F32_UNIT
    return scale, -((w >> INT4_VALUE_BITS).to(tl.float32) * scale) * INT4_ZERO_STEP


@triton.jit
def int4_key_words(page, h, H, D: tl.constexpr):
    """Offset of a page-head's key scale words (``[.., 1, H, D + 1]`` int16: the unit's BF16 bits last)."""
    return (page * H + h) * (D + 1)


@triton.jit
def load_decoded(
    p0,
    p1,
    p2,
    page,
    tok,
    h,
    d,
    valid,
    row_ok,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    FMT: tl.constexpr,
    CHANNEL: tl.constexpr,
):
    """float32 ``[N, BLOCK_D]`` tile of one head of cold pages.

    ``page`` and ``tok`` (``[N, 1]`` int64) name a token of a page, ``d`` (``[1, BLOCK_D]``) the channel;
    ``valid`` masks the elements to read and ``row_ok`` (``[N, 1]``) the tokens (the rest decode to 0).
    ``CHANNEL``: scales per channel over the page (keys) instead of per token (values). Parts are
    ``[pages, P, H, ...]`` as the codec lays them out. Per-token scales are loaded once per row.
    """
    row = (page * P + tok) * H + h  # the (page, token, head) row of a [pages, P, H, *] part
    if CHANNEL:
        srow = (page * H + h) * D + d  # [N, BLOCK_D]: the row's page's scale of each channel
        s_ok = valid
    else:
        srow = row  # [N, 1]: the row's own scale
        s_ok = row_ok
    if FMT == 5 or FMT == 6:
        # Each channel reads its byte (neighbours share it: one cache line) and takes its nibble.
        # (Whole-byte loads unpacked with tl.interleave gave wrong BF16 results on Triton 3.6.)
        byte = tl.load(p0 + row * (D // 2) + d // 2, mask=valid, other=0).to(tl.int32)
        c = (byte >> ((d & 1) * 4)) & 15  # element 2i: low nibble
    if FMT == 0:
        x = tl.load(p0 + row * D + d, mask=valid, other=0.0).to(tl.float32)
    elif FMT == 1 or FMT == 2:
        x = fp8_value(tl.load(p0 + row * D + d, mask=valid, other=0), FMT == 2)
        if CHANNEL:  # one exponent per page and head
            x = x * pow2_scale(tl.load(p1 + page * H + h, mask=row_ok, other=127))
        else:
            x = x * pow2_scale(tl.load(p1 + row, mask=row_ok, other=127))
    elif FMT == 3 or FMT == 4:
        x = tl.load(p0 + row * D + d, mask=valid, other=0).to(tl.float32)
        x = x * tl.load(p1 + srow, mask=s_ok, other=0.0)
        if FMT == 4:
            x = x + tl.load(p2 + srow, mask=s_ok, other=0.0)
    elif FMT == 5:
        if CHANNEL:
            w0 = int4_key_words(page, h, H, D)
            unit = bf16_bits_value(tl.load(p1 + w0 + D, mask=row_ok, other=0))
            s, o = int4_key_scale(tl.load(p1 + w0 + d, mask=valid, other=0).to(tl.int32), unit)
        else:
            s, o = int4_value_scale(tl.load(p1 + row, mask=row_ok, other=0).to(tl.int32))
        x = c.to(tl.float32) * s + o
    else:
        v = e2m1_value(c.to(tl.int32))
        if CHANNEL:
            bs = tl.load(p1 + ((page * (P // 16) + tok // 16) * H + h) * D + d, mask=valid, other=0)
            x = v * (fp8_value(bs, False) * tl.load(p2 + page * H + h, mask=row_ok, other=0.0).to(tl.float32))
        else:
            bs = tl.load(p1 + row * (D // 32) + d // 32, mask=valid, other=0)
            x = v * (fp8_value(bs, False) * tl.load(p2 + row, mask=row_ok, other=0.0).to(tl.float32))
    return x


# Block decoding for the decode kernel: a tile is whole 16-token blocks, each inside one page (and
# one fp4 key block), read as [blocks, 16, channels]. A key's per-channel scale is then one vector per
# block, loaded once and broadcast over its 16 tokens (no per-element scale gather); a value's
# per-token scale folds into the softmax weights ((p * s_v) . codes + p . offset_v), so value codes
# reach tl.dot only converted to the dot dtype. 4-bit codes are read once per byte: the low nibbles
# are the even channels and the high ones the odd channels, and the caller splits q and the output
# into even/odd halves instead of interleaving the codes.


@triton.jit
def tile_codes(p0, row, c, c_ok, D: tl.constexpr, FMT: tl.constexpr, HALF: tl.constexpr):
    """float32 codes ``(x0, x1)`` at rows ``row`` and channels ``c`` (broadcastable shapes, rows
    ``[..., 1]``, channels ``[1, ..., C]``). ``HALF``: ``c`` indexes bytes, x0 holds the low nibbles
    (even channels), x1 the high ones (odd); else x1 is x0. fp4 codes come out as E2M1 values, the
    rest as the raw code (scales are the caller's)."""
    if HALF:
        byte = tl.load(p0 + row * (D // 2) + c, mask=c_ok, other=0).to(tl.int32)
        lo = byte & 15
        hi = byte >> 4
        if FMT == 6:
            x0 = e2m1_value(lo)
            x1 = e2m1_value(hi)
        else:
            x0 = nibble_value(lo)
            x1 = nibble_value(hi)
    else:
        raw = tl.load(p0 + row * D + c, mask=c_ok, other=0)
        if FMT == 1 or FMT == 2:  # noqa: SIM108  (constexpr branches of a Triton function)
            x0 = fp8_value(raw, FMT == 2)
        else:
            x0 = raw.to(tl.float32)
        x1 = x0
    return x0, x1


@triton.jit
def key_block_scales(
    p1, p2, page, tok0, h, c0, c1, c_ok, H, P: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr
):
    """Per-channel key scales ``(s0, s1)`` and offsets ``(o0, o1)`` (float32, 0 without offsets) over
    channels ``c0``/``c1`` of the 16-token blocks of ``page`` starting at token ``tok0`` (``page`` and
    ``tok0`` ``[..., 1]`` int64, channels ``[1, ..., C]``)."""
    srow = (page * H + h) * D
    if FMT == 1 or FMT == 2:  # one exponent per page and head, broadcast over the channels
        e = pow2_scale(tl.load(p1 + page * H + h))
        s0 = tl.where(c_ok, e, 1.0)
        s1 = s0
    elif FMT == 6:
        g = tl.load(p2 + page * H + h).to(tl.float32)
        s0, s1 = fp4_key_block_scales(p1, page, tok0, h, c0, c1, c_ok, H, P, D)
        s0 = s0 * g
        s1 = s1 * g
    elif FMT == 5:  # a word per channel, the page-head unit after them
        w0 = int4_key_words(page, h, H, D)
        unit = bf16_bits_value(tl.load(p1 + w0 + D))
        s0, o0 = int4_key_scale(tl.load(p1 + w0 + c0, mask=c_ok, other=0).to(tl.int32), unit)
        s1, o1 = int4_key_scale(tl.load(p1 + w0 + c1, mask=c_ok, other=0).to(tl.int32), unit)
    else:
        s0 = tl.load(p1 + srow + c0, mask=c_ok, other=0.0).to(tl.float32)
        s1 = tl.load(p1 + srow + c1, mask=c_ok, other=0.0).to(tl.float32)
    if FMT != 5:
        o0 = tl.zeros(s0.shape, tl.float32)
        o1 = o0
        if FMT == 4:
            o0 = tl.load(p2 + srow + c0, mask=c_ok, other=0.0).to(tl.float32)
            o1 = tl.load(p2 + srow + c1, mask=c_ok, other=0.0).to(tl.float32)
    return s0, s1, o0, o1


@triton.jit
def value_tile_scales(p1, p2, row, FMT: tl.constexpr):
    """Per-token value scales and offsets (float32, shaped as ``row``) of the tile's rows; for fp4 its
    per-token global scale (its E4M3 block scales vary along head_dim: `fp4_value_codes`)."""
    o = tl.zeros(row.shape, tl.float32)
    if FMT == 1 or FMT == 2:
        s = pow2_scale(tl.load(p1 + row))
    elif FMT == 6:
        s = tl.load(p2 + row).to(tl.float32)
    elif FMT == 5:
        s, o = int4_value_scale(tl.load(p1 + row).to(tl.int32))
    else:
        s = tl.load(p1 + row).to(tl.float32)
        if FMT == 4:
            o = tl.load(p2 + row).to(tl.float32)
    return s, o


@triton.jit
def fp4_value_codes(p0, p1, row, ok, D: tl.constexpr, BLOCK_C: tl.constexpr, OUT: tl.constexpr):
    """fp4 values at rows ``row`` (``[N]`` int64; ``ok`` the rows to read) as E2M1 times their E4M3
    block scale (cast to ``OUT``, exact in BF16; the per-token global scale is the caller's), in
    even/odd channel halves ``(x0, x1)`` ``[N, BLOCK_C]`` (``BLOCK_C`` bytes a row, a multiple of 16).
    Read as ``[N, blocks, 16 bytes]``: bytes ``16i`` to ``16i + 15`` hold channels ``32i`` to
    ``32i + 31``, one block, so a block's scale loads once per row and broadcasts over its 16 bytes
    (no per-element scale gather)."""
    g = tl.arange(0, BLOCK_C // 16)[None, :, None]
    j = tl.arange(0, 16)[None, None, :]
    r = row[:, None, None]
    r_ok = ok[:, None, None]
    byte = tl.load(p0 + r * (D // 2) + g * 16 + j, mask=r_ok & (g * 16 + j < D // 2), other=0).to(tl.int32)
    s = fp8_value(tl.load(p1 + r * (D // 32) + g, mask=r_ok & (g < D // 32), other=0), False)
    x0 = tl.reshape((e2m1_value(byte & 15) * s).to(OUT), [row.shape[0], BLOCK_C])
    x1 = tl.reshape((e2m1_value(byte >> 4) * s).to(OUT), [row.shape[0], BLOCK_C])
    return x0, x1


# Packed 4-bit decoding for the 4-bit decode kernel (`kvstrata.radix.kernels.decode4`): whole bytes in,
# FP16 pairs out, four bytes (eight codes) an instance of inline PTX. int4: a byte pair is spread over
# two 16-bit lanes (prmt), then one lop3 a lane pair puts a nibble under an FP16 exponent, codes as
# 1024 + c (low nibble) or 64 + c (high nibble, whose bits sit 4 higher), the bias subtracted exactly
# by a packed FP16 subtraction. fp4: the four low nibbles are first rewritten in place as E5M2 bytes
# (sign to bit 7, exponent and mantissa bits to bits 1-3: `_FP4_BYTES`, four codes an instruction), the
# high nibbles likewise, and a prmt then puts two such bytes under two FP16 lanes' high bytes, which
# reads an E5M2 byte as FP16 exactly: the E2M1 value times 2**-14, as `e2m1_value` (11 instructions an
# instance against 18 for spreading first and placing the bits lane by lane). Scales and offsets apply as
# packed FP16 products (``fma.rn.f16x2``). Operands ($n): outputs low nibbles (2 registers), high
# nibbles (2), then the bytes (1), then the FP16 scale and offset pairs of the low and of the high
# nibbles.
_SPREAD = """
.reg .b32 z, t0, t1, a, b, m;
mov.b32 z, 0;
prmt.b32 t0, $4, z, 0x4140;
prmt.b32 t1, $4, z, 0x4342;
"""
_INT4_NIBBLE = """
mov.b32 m, {bias};
lop3.b32 a, t0, {mask}, m, 0xEA;
sub.f16x2 a, a, m;
lop3.b32 b, t1, {mask}, m, 0xEA;
sub.f16x2 b, b, m;
"""
# Low nibbles (s e1 e0 m in bits 0-3 of each byte): bits 0-2 up one, bit 3 up four; high nibbles (bits
# 4-7): bits 4-6 down three, bit 7 in place. Bits shifted in from a neighbouring byte are masked off.
_FP4_BYTES = """
.reg .b32 z, t0, t1, a, b, m;
mov.b32 z, 0;
shl.b32 t0, $4, 1;
and.b32 t0, t0, 0x0E0E0E0E;
shl.b32 m, $4, 4;
lop3.b32 t0, m, 0x80808080, t0, 0xEA;
shr.b32 t1, $4, 3;
and.b32 t1, t1, 0x0E0E0E0E;
lop3.b32 t1, $4, 0x80808080, t1, 0xEA;
"""
_FP4_NIBBLE = """
prmt.b32 a, {bytes}, z, 0x1404;
prmt.b32 b, {bytes}, z, 0x3424;
"""
_LO = dict(bias="0x64006400", mask="0x000F000F", bytes="t0")
_HI = dict(bias="0x54005400", mask="0x00F000F0", bytes="t1")
_OUT = {
    "plain": "mov.b32 ${0}, a;\nmov.b32 ${1}, b;\n",
    "scale": "mul.rn.f16x2 ${0}, a, ${2};\nmul.rn.f16x2 ${1}, b, ${3};\n",
    "affine": "fma.rn.f16x2 ${0}, a, ${2}, ${4};\nfma.rn.f16x2 ${1}, b, ${3}, ${5};\n",
}


def _nibbles_asm(nibble: str, out: str) -> str:
    """PTX of one packed decode: ``nibble`` the per-nibble code (`_INT4_NIBBLE`/`_FP4_NIBBLE`), ``out``
    how its FP16 pairs leave (`_OUT`)."""
    per_half = {"plain": 0, "scale": 2, "affine": 4}[out]  # scale/offset registers per nibble half
    body = _FP4_BYTES if nibble is _FP4_NIBBLE else _SPREAD
    for half, regs in ((_LO, (0, 1)), (_HI, (2, 3))):
        first = 5 + (half is _HI) * per_half
        operands = (*regs, first, first + 1, first + 2, first + 3)
        body += nibble.format(**half) + _OUT[out].format(*operands)
    return "{\n" + body + "}"


# Half-word decoding (`nibble_quads`): two 16-bit elements (four codes each) an instance, and out of it
# one register a code position, holding that position's code of both elements. An operand that pairs
# the same channel of two keys (P.V's, whose reduction runs over keys) then comes from one transposing
# ldmatrix of 16-bit elements, with no byte gathering. fp4: `_FP4_BYTES`, then a prmt a position takes
# its E5M2 byte of each element (bytes 0 and 2: codes 0 of the two elements, 1 and 3: codes 2). int4:
# a lop3 a position under an FP16 exponent as in `_INT4_NIBBLE` (positions 2 and 3 after one shift).
# Operands: outputs codes 0 to 3 (one register each), then the two elements (1), then fp4's FP16 scale pair.
_FP4_QUADS = (
    _FP4_BYTES
    + "prmt.b32 a, t0, z, 0x2404;\nprmt.b32 b, t1, z, 0x2404;\n"
    + "prmt.b32 t0, t0, z, 0x3414;\nprmt.b32 t1, t1, z, 0x3414;\n"
)
_INT4_QUADS = """
.reg .b32 a, b, t0, t1, lo, hi, w;
mov.b32 lo, 0x64006400;
mov.b32 hi, 0x54005400;
shr.b32 w, $4, 8;
lop3.b32 a, $4, 0x000F000F, lo, 0xEA;
sub.f16x2 a, a, lo;
lop3.b32 b, $4, 0x00F000F0, hi, 0xEA;
sub.f16x2 b, b, hi;
lop3.b32 t0, w, 0x000F000F, lo, 0xEA;
sub.f16x2 t0, t0, lo;
lop3.b32 t1, w, 0x00F000F0, hi, 0xEA;
sub.f16x2 t1, t1, hi;
"""
_QUADS_OUT = {
    "plain": "".join(f"mov.b32 ${i}, {r};\n" for i, r in enumerate(("a", "b", "t0", "t1"))),
    "scale": "".join(f"mul.rn.f16x2 ${i}, {r}, $5;\n" for i, r in enumerate(("a", "b", "t0", "t1"))),
}
FP4_QUADS_SCALED_ASM = tl.constexpr("{\n" + _FP4_QUADS + _QUADS_OUT["scale"] + "}")
INT4_QUADS_ASM = tl.constexpr("{\n" + _INT4_QUADS + _QUADS_OUT["plain"] + "}")


INT4_CODES_ASM = tl.constexpr(_nibbles_asm(_INT4_NIBBLE, "plain"))
# ``MAGIC`` int4 codes (`nibble_pairs`, `nibble_quads`): the lop3's FP16 values as they are, ``1024 + c``
# (low nibbles, code positions 0 and 2 of a half-word) or ``64 + c`` (high nibbles, positions 1 and 3),
# without the packed subtraction (a quarter of the decode's instructions); the kernel takes the offsets
# off in its products' accumulators (`decode4._cold_tile4`).
INT4_MAGIC_LO = tl.constexpr(1024.0)
INT4_MAGIC_HI = tl.constexpr(64.0)


def _without_subtractions(ptx: str) -> str:
    """``ptx`` without its ``sub`` instructions (one a line)."""
    return "".join(line + "\n" for line in ptx.strip().split("\n") if not line.startswith("sub."))


INT4_MAGIC_ASM = tl.constexpr(_nibbles_asm(_without_subtractions(_INT4_NIBBLE), "plain"))
INT4_QUADS_MAGIC_ASM = tl.constexpr("{\n" + _without_subtractions(_INT4_QUADS) + _QUADS_OUT["plain"] + "}")
INT4_AFFINE_ASM = tl.constexpr(_nibbles_asm(_INT4_NIBBLE, "affine"))
FP4_CODES_ASM = tl.constexpr(_nibbles_asm(_FP4_NIBBLE, "plain"))
FP4_SCALED_ASM = tl.constexpr(_nibbles_asm(_FP4_NIBBLE, "scale"))


@triton.jit
def nibble_pairs(
    byte,
    s0,
    o0,
    s1,
    o1,
    FMT: tl.constexpr,
    SCALED: tl.constexpr,
    ASM: tl.constexpr,
    OUT: tl.constexpr,
    MAGIC: tl.constexpr = False,
):
    """Both nibbles of uint8 ``byte`` as ``OUT`` ``(x0, x1)``: low nibbles (even channels), high ones
    (odd). int4: the code, or with ``SCALED`` ``code * s + o``; fp4 (FMT 6): the E2M1 value times
    2**-14, with ``SCALED`` times ``s`` (a block scale; exact in FP16: E2M1 and E4M3 products are
    multiples of 2**-10 below 2688 with at most 6 significant bits). ``s0``/``o0`` go with the low
    nibbles, ``s1``/``o1`` with the high ones (broadcastable to ``byte``; unused ones may be
    anything). ``ASM``: packed PTX (`_nibbles_asm`; FP16 ``OUT`` on a GPU only), else float32
    arithmetic cast to ``OUT``. ``MAGIC`` (int4, unscaled): ``INT4_MAGIC_LO + code`` for the low
    nibbles and ``INT4_MAGIC_HI + code`` for the high ones (`INT4_MAGIC_ASM`)."""
    tl.static_assert(not MAGIC or (FMT == 5 and not SCALED), "MAGIC codes are unscaled int4 codes")
    if ASM and MAGIC:
        x0, x1 = tl.inline_asm_elementwise(
            INT4_MAGIC_ASM, "=r,=r,=r,=r,r", [byte], (tl.float16, tl.float16), True, 4
        )
    elif ASM:  # the asm's operands broadcast to ``byte`` (`tl.inline_asm_elementwise` broadcasts them)
        if FMT == 6 and SCALED:
            x0, x1 = tl.inline_asm_elementwise(
                FP4_SCALED_ASM, "=r,=r,=r,=r,r,r,r,r,r", [byte, s0.to(tl.float16), s1.to(tl.float16)],
                (tl.float16, tl.float16), True, 4,
            )  # fmt: skip
        elif FMT == 6:
            x0, x1 = tl.inline_asm_elementwise(
                FP4_CODES_ASM, "=r,=r,=r,=r,r", [byte], (tl.float16, tl.float16), True, 4
            )
        elif SCALED:
            x0, x1 = tl.inline_asm_elementwise(
                INT4_AFFINE_ASM, "=r,=r,=r,=r,r,r,r,r,r,r,r,r,r",
                [byte, s0.to(tl.float16), o0.to(tl.float16), s1.to(tl.float16), o1.to(tl.float16)],
                (tl.float16, tl.float16), True, 4,
            )  # fmt: skip
        else:
            x0, x1 = tl.inline_asm_elementwise(
                INT4_CODES_ASM, "=r,=r,=r,=r,r", [byte], (tl.float16, tl.float16), True, 4
            )
    else:
        b = byte.to(tl.int32)
        if FMT == 6:
            x0 = e2m1_value(b & 15) * 6.103515625e-05
            x1 = e2m1_value(b >> 4) * 6.103515625e-05
        else:
            x0 = nibble_value(b & 15)
            x1 = nibble_value(b >> 4)
            if MAGIC:
                x0 += INT4_MAGIC_LO
                x1 += INT4_MAGIC_HI
        if SCALED and FMT == 6:
            x0 = x0 * s0.to(tl.float32)
            x1 = x1 * s1.to(tl.float32)
        elif SCALED:
            x0 = x0 * s0.to(tl.float32) + o0.to(tl.float32)
            x1 = x1 * s1.to(tl.float32) + o1.to(tl.float32)
    return x0.to(OUT), x1.to(OUT)


@triton.jit
def nibble_quads(
    half, s, FMT: tl.constexpr, ASM: tl.constexpr, OUT: tl.constexpr, MAGIC: tl.constexpr = False
):
    """The four codes of uint16 ``half`` (bits 4i to 4i + 3: channel 4j + i of element j) as ``OUT``
    ``(x0, x1, x2, x3)``: int4 the code; fp4 (FMT 6) the E2M1 value times 2**-14 times ``s`` (a block
    scale broadcastable to ``half``; exact in FP16, as in `nibble_pairs`). ``ASM``: packed PTX
    (`FP4_QUADS_SCALED_ASM` / `INT4_QUADS_ASM`, FP16 ``OUT`` on a GPU only), else float32 arithmetic.
    ``MAGIC`` (int4): positions 0 and 2 ``INT4_MAGIC_LO + code``, 1 and 3 ``INT4_MAGIC_HI + code``
    (`INT4_QUADS_MAGIC_ASM`)."""
    tl.static_assert(not MAGIC or FMT == 5, "MAGIC codes are int4 codes")
    if ASM and MAGIC:
        x0, x1, x2, x3 = tl.inline_asm_elementwise(
            INT4_QUADS_MAGIC_ASM, "=r,=r,=r,=r,r", [half], (tl.float16,) * 4, True, 2
        )
    elif ASM:
        if FMT == 6:
            x0, x1, x2, x3 = tl.inline_asm_elementwise(
                FP4_QUADS_SCALED_ASM, "=r,=r,=r,=r,r,r", [half, s.to(tl.float16)], (tl.float16,) * 4, True, 2
            )
        else:
            x0, x1, x2, x3 = tl.inline_asm_elementwise(
                INT4_QUADS_ASM, "=r,=r,=r,=r,r", [half], (tl.float16,) * 4, True, 2
            )
    else:
        h = half.to(tl.int32)
        if FMT == 6:
            f = s.to(tl.float32) * 6.103515625e-05
            x0 = e2m1_value(h & 15) * f
            x1 = e2m1_value((h >> 4) & 15) * f
            x2 = e2m1_value((h >> 8) & 15) * f
            x3 = e2m1_value((h >> 12) & 15) * f
        else:
            x0 = nibble_value(h & 15)
            x1 = nibble_value((h >> 4) & 15)
            x2 = nibble_value((h >> 8) & 15)
            x3 = nibble_value((h >> 12) & 15)
            if MAGIC:
                x0 += INT4_MAGIC_LO
                x1 += INT4_MAGIC_HI
                x2 += INT4_MAGIC_LO
                x3 += INT4_MAGIC_HI
    return x0.to(OUT), x1.to(OUT), x2.to(OUT), x3.to(OUT)


@triton.jit
def fp4_key_block_scales(p1, page, tok0, h, c0, c1, c_ok, H, P: tl.constexpr, D: tl.constexpr):
    """fp4 keys' E4M3 block scales ``(b0, b1)`` (float32) over channels ``c0``/``c1`` of the 16-token
    blocks of ``page`` starting at ``tok0`` (shapes as `key_block_scales`'), without the page's global
    scale (which `key_block_scales` folds in)."""
    brow = ((page * (P // 16) + tok0 // 16) * H + h) * D
    b0 = fp8_value(tl.load(p1 + brow + c0, mask=c_ok, other=0), False)
    b1 = fp8_value(tl.load(p1 + brow + c1, mask=c_ok, other=0), False)
    return b0, b1


@triton.jit
def fp4_key_block_pairs(p1, page, tok0, h, pair, H, P: tl.constexpr, D: tl.constexpr):
    """`fp4_key_block_scales` of the even and odd channels ``2 * pair`` and ``2 * pair + 1``, read as
    one 16-bit element a channel pair (the even channel's code the low byte): loads of at least 32
    bits a thread, which Triton's pipeliner copies ahead asynchronously (it leaves narrower loads in
    the loop)."""
    brow = ((page * (P // 16) + tok0 // 16) * H + h) * (D // 2)
    w = tl.load(p1.to(tl.pointer_type(tl.uint16)) + brow + pair).to(tl.int32)
    return fp8_value((w & 255).to(tl.uint8), False), fp8_value((w >> 8).to(tl.uint8), False)
