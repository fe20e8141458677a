"""Triton device function that encodes one head of a page into a codec's parts (the page-quantize
kernel's view), operation for operation as the torch codecs do, so the codes are bit-identical.

The page arrives as two float32 tiles: even channels ``xe`` and odd channels ``xo`` (``[BLOCK_P,
BLOCK_D2]``), which is how the 4-bit codecs pack a byte (low nibble: even channel). Rows past the page
and channels past head_dim must be zeros (they never raise an absmax; their codes are not stored).
Dynamic scales only: static clips (calibration files) stay on the torch path.

The torch operations this mirrors: divisions are correctly rounded (``div_rn``), ``torch.round`` is
round-half-to-even (``rint``), float casts to FP8 round to nearest even, and E2M1 codes round ties
toward zero (``bucketize`` over the midpoints).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvstrata.quant import int4
from kvstrata.quant.kernel_decode import (
    INT4_KEY_EMIN,
    INT4_KEY_M,
    INT4_VALUE_BITS,
    INT4_VALUE_EMIN,
    INT4_VALUE_M,
    INT4_ZERO_STEP,
    bf16_bits_value,
    fp8_value,
    int4_key_words,
    minifloat_value,
)

INT4_KEY_EMAX = tl.constexpr(int4.KEY_SCALE.emax)
INT4_KEY_MAX = tl.constexpr(int4.KEY_SCALE.max)
INT4_VALUE_EMAX = tl.constexpr(int4.VALUE_SCALE.emax)
INT4_VALUE_MAX = tl.constexpr(int4.VALUE_SCALE.max)
INT4_UNIT_STEPS = tl.constexpr(float(int4.UNIT_STEPS))
INT4_ZERO_STEPS = tl.constexpr(float(int4.ZERO_STEPS))
INT4_ZERO_MAX = tl.constexpr(float(int4.ZERO_MAX))


@triton.jit
def _amax(x, CHANNEL: tl.constexpr):
    """absmax per channel (over tokens, ``[1, C]``) or per token (over channels, ``[P, 1]``)."""
    if CHANNEL:
        return tl.max(tl.abs(x), 0)[None, :]
    else:
        return tl.max(tl.abs(x), 1)[:, None]


@triton.jit
def _amin2(xe, xo, CHANNEL: tl.constexpr):
    if CHANNEL:
        return tl.min(xe, 0)[None, :], tl.min(xo, 0)[None, :]
    else:
        m = tl.minimum(tl.min(xe, 1), tl.min(xo, 1))[:, None]
        return m, m


@triton.jit
def _amax2(xe, xo, CHANNEL: tl.constexpr):
    if CHANNEL:
        return tl.max(xe, 0)[None, :], tl.max(xo, 0)[None, :]
    else:
        m = tl.maximum(tl.max(xe, 1), tl.max(xo, 1))[:, None]
        return m, m


@triton.jit
def _abs2(xe, xo, CHANNEL: tl.constexpr):
    if CHANNEL:
        return _amax(xe, True), _amax(xo, True)
    else:
        m = tl.maximum(_amax(xe, False), _amax(xo, False))
        return m, m


@triton.jit
def _safe(s):
    return tl.where(s > 0, s, 1.0)


@triton.jit
def _rint(x):
    """Round half to even for ``|x| < 2**22`` (the codes here are below 2**9): adding 1.5 * 2**23
    leaves no fraction bits, so the add rounds as IEEE does; the subtraction is exact."""
    return (x + 12582912.0) - 12582912.0


@triton.jit
def fp8_bits(y, E5M2: tl.constexpr):
    """float32 values within the format's finite range to FP8 bit patterns (uint8), round to nearest
    even, as torch's cast does. Integer arithmetic: the interpreter's own FP8 cast does not round so."""
    if E5M2:
        M: tl.constexpr = 2
        BIAS: tl.constexpr = 15
    else:
        M: tl.constexpr = 3
        BIAS: tl.constexpr = 7
    bits = y.to(tl.int32, bitcast=True)
    a = tl.abs(y)
    e = tl.maximum(((a.to(tl.int32, bitcast=True) >> 23) & 255) - 127, 1 - BIAS)  # binade (>= min normal)
    inv_quantum = ((127 - (e - M)) << 23).to(tl.float32, bitcast=True)  # exact power of two
    n = _rint(a * inv_quantum).to(tl.int32)  # steps of the binade's quantum, 0..2**(M+1)
    # Normal binades: exponent field e + BIAS, mantissa n - 2**M; a carry (n = 2**(M+1)) lands on the
    # next binade by itself, and the lowest binade gives subnormal codes n < 2**M.
    code = ((e + BIAS) << M) + n - (1 << M)
    return (code | ((bits >> 31) & 1) << 7).to(tl.uint8)


@triton.jit
def to_storage(x, ty: tl.constexpr):
    """float32 ``x`` cast to a raw storage dtype, rounding to nearest even as torch does. BF16 buffers
    travel as int16 (`as_bits`) and get their bits here: the interpreter's BF16 cast truncates, and a
    GPU cast would turn NaN into another NaN pattern than torch's 0x7FC0."""
    if ty == tl.int16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        return tl.where(x != x, 0x7FC0, rounded).to(tl.int16)
    else:
        return x.to(ty)


@triton.jit
def _pow2_exponent(absmax, FMAX: tl.constexpr):
    """``ceil(log2(absmax / FMAX))`` clamped to [-127, 127], 0 for absmax 0 (`fp8.pow2_scale_exponent`)."""
    ratio = tl.math.div_rn(absmax, tl.full(absmax.shape, FMAX, tl.float32))
    small = ratio < 1.1754943508222875e-38  # subnormal: normalise exactly before reading the bits
    r = tl.where(small, ratio * 18446744073709551616.0, ratio)
    bits = r.to(tl.int32, bitcast=True)
    biased = (bits >> 23) & 255
    exact = (bits & 0x7FFFFF) == 0  # frexp mantissa 0.5: an exact power of two
    e = biased - tl.where(exact, 127, 126) - tl.where(small, 64, 0)
    e = tl.where(ratio == 0, 0, e)
    return tl.minimum(tl.maximum(e, -127), 127)


@triton.jit
def _pow2(e):
    """``2.0 ** e`` for int32 ``e`` in [-127, 127], exact (``2 ** -127`` is subnormal)."""
    normal = ((e + 127) << 23).to(tl.float32, bitcast=True)
    return tl.where(e == -127, 5.877471754111438e-39, normal)


@triton.jit
def _minifloat_code(r, M: tl.constexpr, EMIN: tl.constexpr, EMAX: tl.constexpr, RMAX: tl.constexpr):
    """int32 `MiniFloat` code nearest ``r`` (clamped to ``[0, RMAX]``), as `MiniFloat.encode` computes it."""
    r = tl.minimum(tl.maximum(r, 0.0), RMAX)
    e = tl.minimum(tl.maximum((r.to(tl.int32, bitcast=True) >> 23) - 127, EMIN), EMAX)
    n = _rint(r * ((-e + (127 + M)) << 23).to(tl.float32, bitcast=True)).to(tl.int32)
    # Exponent field e - EMIN + 1 and mantissa n - 2**M of a normal binade, which sum to this; a carry
    # (n = 2**(M+1)) lands on the next binade by itself and the lowest binade's n < 2**M is subnormal.
    return ((e - EMIN) << M) + n


@triton.jit
def _int4_codes(x, offset, scale):
    """int32 codes in [0, 15] of ``x ~ code * scale + offset`` (`affine.affine_codes`)."""
    c = _rint(tl.math.div_rn(x - offset, _safe(scale) + 0.0 * x))
    return tl.minimum(tl.maximum(c, 0.0), 15.0).to(tl.int32)


@triton.jit
def _int4_key_word(lo, hi, unit):
    """A channel's int4 key scale word (int32), scale and offset, from its range and page-head unit."""
    su = _safe(unit)
    zero = tl.minimum(tl.maximum(_rint(tl.math.div_rn(lo, su + 0.0 * lo)), -128.0), 127.0)
    offset = zero * unit
    ratio = tl.math.div_rn(tl.math.div_rn(hi - offset, tl.full(hi.shape, 15.0, tl.float32)), su + 0.0 * hi)
    code = _minifloat_code(ratio, INT4_KEY_M, INT4_KEY_EMIN, INT4_KEY_EMAX, INT4_KEY_MAX)
    scale = minifloat_value(code, INT4_KEY_M, INT4_KEY_EMIN) * unit
    return code | (zero.to(tl.int32) << 8), scale, offset


@triton.jit
def _encode_int4(
    xe, xo, ok, p0, p1, row, page, h, H, tok, i, P: tl.constexpr, D: tl.constexpr, CHANNEL: tl.constexpr
):
    """`kvstrata.quant.int4` with dynamic scales: codes and scale words (keys: one per channel and the
    page-head unit; values: one per token)."""
    de = 2 * i
    lo_e, lo_o = _amin2(tl.where(ok, xe, float("inf")), tl.where(ok, xo, float("inf")), CHANNEL)
    hi_e, hi_o = _amax2(tl.where(ok, xe, float("-inf")), tl.where(ok, xo, float("-inf")), CHANNEL)
    if CHANNEL:
        amax = tl.max(tl.maximum(tl.maximum(-lo_e, hi_e), tl.maximum(-lo_o, hi_o)), 1)[:, None]  # [1, 1]
        unit = tl.math.div_rn(amax, tl.full(amax.shape, INT4_UNIT_STEPS, tl.float32))
        unit_bits = to_storage(unit, tl.int16)  # BF16, rounded to nearest even
        unit = bf16_bits_value(unit_bits)
        we, se, oe = _int4_key_word(lo_e, hi_e, unit)
        wo, so, oo = _int4_key_word(lo_o, hi_o, unit)
        w0 = int4_key_words(page, h, H, D)
        w_ok = (de < D) & (tok == 0)
        tl.store(p1 + w0 + de + 0 * tok, we.to(tl.int16) + 0 * tok.to(tl.int16), mask=w_ok)
        tl.store(p1 + w0 + de + 1 + 0 * tok, wo.to(tl.int16) + 0 * tok.to(tl.int16), mask=w_ok)
        tl.store(p1 + w0 + D + 0 * tok, unit_bits + 0 * tok.to(tl.int16), mask=tok == 0)
    else:  # values: the token's range widened to include 0; both halves share the token's word
        lo = tl.minimum(lo_e, 0.0)
        hi = tl.maximum(hi_e, 0.0)
        code = _minifloat_code(
            tl.math.div_rn(hi - lo, tl.full(hi.shape, 15.0, tl.float32)),
            INT4_VALUE_M,
            INT4_VALUE_EMIN,
            INT4_VALUE_EMAX,
            INT4_VALUE_MAX,
        )
        se = minifloat_value(code, INT4_VALUE_M, INT4_VALUE_EMIN)
        zero = _rint(tl.math.div_rn(-lo, _safe(se)) * INT4_ZERO_STEPS)
        zero = tl.minimum(tl.maximum(zero, 0.0), INT4_ZERO_MAX)
        oe = -(zero * se) * INT4_ZERO_STEP
        so = se
        oo = oe
        tl.store(p1 + row, (code | (zero.to(tl.int32) << INT4_VALUE_BITS)).to(tl.int16), mask=tok < P)
    ce = _int4_codes(xe, oe, se)
    co = _int4_codes(xo, oo, so)
    tl.store(p0 + row * (D // 2) + i, (ce | (co << 4)).to(tl.uint8), mask=ok)


@triton.jit
def _e2m1_codes(y):
    """E2M1 code of each element of ``y`` (within ±6): index = midpoints strictly below |y|, sign bit 3."""
    a = tl.abs(y)
    i = (
        (a > 0.25).to(tl.int32)
        + (a > 0.75).to(tl.int32)
        + (a > 1.25).to(tl.int32)
        + (a > 1.75).to(tl.int32)
        + (a > 2.5).to(tl.int32)
        + (a > 3.5).to(tl.int32)
        + (a > 5.0).to(tl.int32)
    )
    return i | ((y < 0).to(tl.int32) << 3)


@triton.jit
def _block_amax(x, CHANNEL: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D2: tl.constexpr):
    """absmax per block: 16 tokens per channel (``[BLOCK_P // 16, BLOCK_D2]``) or 32 channels per
    token; one half tile holds 16 of them (``[BLOCK_P, BLOCK_D2 // 16]``)."""
    if CHANNEL:
        return tl.max(tl.reshape(tl.abs(x), [BLOCK_P // 16, 16, BLOCK_D2]), 1)
    else:
        return tl.max(tl.reshape(tl.abs(x), [BLOCK_P, BLOCK_D2 // 16, 16]), 2)


@triton.jit
def _expand_blocks(s, CHANNEL: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D2: tl.constexpr):
    """A per-block tensor broadcast back to ``[BLOCK_P, BLOCK_D2]``."""
    if CHANNEL:
        return tl.reshape(tl.broadcast_to(s[:, None, :], [BLOCK_P // 16, 16, BLOCK_D2]), [BLOCK_P, BLOCK_D2])
    else:
        return tl.reshape(tl.broadcast_to(s[:, :, None], [BLOCK_P, BLOCK_D2 // 16, 16]), [BLOCK_P, BLOCK_D2])


@triton.jit
def store_pairs(OUT, row, even, odd, row_ok, D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """Rows ``row`` of ``OUT`` (D elements each, ``row_ok`` of them) from their even and odd channels
    ``[BLOCK_P, BLOCK_D2]``: joined in registers and stored whole (vector stores, not two strided
    element stores a row)."""
    x = tl.reshape(tl.join(even, odd), [even.shape[0], 2 * BLOCK_D2])
    c = tl.arange(0, 2 * BLOCK_D2)[None, :]
    tl.store(OUT + row * D + c, x, mask=row_ok & (c < D))


@triton.jit
def encode_store(
    xe,
    xo,
    p0,
    p1,
    p2,
    page,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    FMT: tl.constexpr,
    CHANNEL: tl.constexpr,
):
    """Encode head ``h`` of page ``page`` (int64) from ``xe``/``xo`` and store every part of a coded
    format (raw rows, format 0, are the caller's: `store_pairs` of the rows themselves)."""
    tl.static_assert(FMT != 0, "encode_store: raw rows are stored by the caller (store_pairs)")
    tok = tl.arange(0, BLOCK_P)[:, None]
    i = tl.arange(0, BLOCK_D2)[None, :]
    de = 2 * i
    ok = (tok < P) & (de < D)
    row = (page * P + tok) * H + h  # [BLOCK_P, 1]
    if CHANNEL:
        s_ok_e = (de < D) & (tok == 0)
        se_off = (page * H + h) * D + de + 0 * tok  # scale of channel de, stored once per page
        so_off = se_off + 1
    else:
        s_ok_e = (tok < P) & (i == 0)
        se_off = row + 0 * i
        so_off = se_off
    if FMT == 1 or FMT == 2:
        if FMT == 2:
            fmax: tl.constexpr = 57344.0
        else:
            fmax: tl.constexpr = 448.0
        ae, ao = _abs2(xe, xo, CHANNEL)
        if CHANNEL:  # one exponent per page and head: [1, 1]
            ae = tl.max(tl.maximum(ae, ao), 1)[:, None]
        ee = _pow2_exponent(ae, fmax)
        ye = tl.minimum(tl.maximum(xe * _pow2(-ee), -fmax), fmax)
        yo = tl.minimum(tl.maximum(xo * _pow2(-ee), -fmax), fmax)
        store_pairs(p0, row, fp8_bits(ye, FMT == 2), fp8_bits(yo, FMT == 2), tok < P, D, BLOCK_D2)
        if CHANNEL:
            tl.store(
                p1 + page * H + h + 0 * tok, (ee + 127).to(tl.uint8) + 0 * tok.to(tl.uint8), mask=tok == 0
            )
        else:
            tl.store(p1 + row, (ee + 127).to(tl.uint8), mask=tok < P)
    elif FMT == 3:
        ae, ao = _abs2(xe, xo, CHANNEL)
        se = tl.math.div_rn(ae, tl.full(ae.shape, 127.0, tl.float32))
        so = tl.math.div_rn(ao, tl.full(ao.shape, 127.0, tl.float32))
        ce = _rint(tl.math.div_rn(xe, _safe(se) + 0.0 * xe))
        co = _rint(tl.math.div_rn(xo, _safe(so) + 0.0 * xo))
        ce = tl.minimum(tl.maximum(ce, -127.0), 127.0).to(tl.int8)
        co = tl.minimum(tl.maximum(co, -127.0), 127.0).to(tl.int8)
        store_pairs(p0, row, ce, co, tok < P, D, BLOCK_D2)
        tl.store(p1 + se_off, se + 0.0 * tok, mask=s_ok_e)
        if CHANNEL:
            tl.store(p1 + so_off, so + 0.0 * tok, mask=s_ok_e)
    elif FMT == 5:
        _encode_int4(xe, xo, ok, p0, p1, row, page, h, H, tok, i, P, D, CHANNEL)
    elif FMT == 4:
        levels: tl.constexpr = 255.0
        # Rows/channels past the page would join the min/max: take them from the page's own data.
        lo_e, lo_o = _amin2(tl.where(ok, xe, float("inf")), tl.where(ok, xo, float("inf")), CHANNEL)
        hi_e, hi_o = _amax2(tl.where(ok, xe, float("-inf")), tl.where(ok, xo, float("-inf")), CHANNEL)
        se = tl.math.div_rn(hi_e - lo_e, tl.full(hi_e.shape, levels, tl.float32))
        so = tl.math.div_rn(hi_o - lo_o, tl.full(hi_o.shape, levels, tl.float32))
        ce = _rint(tl.math.div_rn(xe - lo_e, _safe(se) + 0.0 * xe))
        co = _rint(tl.math.div_rn(xo - lo_o, _safe(so) + 0.0 * xo))
        ce = tl.minimum(tl.maximum(ce, 0.0), levels).to(tl.int32)
        co = tl.minimum(tl.maximum(co, 0.0), levels).to(tl.int32)
        store_pairs(p0, row, ce.to(tl.uint8), co.to(tl.uint8), tok < P, D, BLOCK_D2)
        tl.store(p1 + se_off, se + 0.0 * tok, mask=s_ok_e)
        tl.store(p2 + se_off, lo_e + 0.0 * tok, mask=s_ok_e)
        if CHANNEL:
            tl.store(p1 + so_off, so + 0.0 * tok, mask=s_ok_e)
            tl.store(p2 + so_off, lo_o + 0.0 * tok, mask=s_ok_e)
    else:
        ae, ao = _abs2(xe, xo, CHANNEL)
        be = _block_amax(xe, CHANNEL, BLOCK_P, BLOCK_D2)
        bo = _block_amax(xo, CHANNEL, BLOCK_P, BLOCK_D2)
        if CHANNEL:  # global scale per page and head [1, 1]; blocks of 16 tokens per channel
            amax = tl.max(tl.maximum(ae, ao), 1)[:, None]
        else:  # global scale per token [BLOCK_P, 1]; a block of 32 channels spans both halves
            amax = ae
            be = tl.maximum(be, bo)
            bo = be
        gb = to_storage(tl.math.div_rn(amax, tl.full(amax.shape, 2688.0, tl.float32)), tl.int16)
        gs = (gb.to(tl.int32) << 16).to(tl.float32, bitcast=True)  # the BF16 global scale's value
        sg = _safe(gs) * 6.0
        bse = fp8_bits(tl.minimum(tl.maximum(tl.math.div_rn(be, sg + 0.0 * be), 0.0), 448.0), False)
        bso = fp8_bits(tl.minimum(tl.maximum(tl.math.div_rn(bo, sg + 0.0 * bo), 0.0), 448.0), False)
        de_ = _safe(fp8_value(_expand_blocks(bse, CHANNEL, BLOCK_P, BLOCK_D2), False) * gs)
        do_ = _safe(fp8_value(_expand_blocks(bso, CHANNEL, BLOCK_P, BLOCK_D2), False) * gs)
        ye = tl.minimum(tl.maximum(tl.math.div_rn(xe, de_), -6.0), 6.0)
        yo = tl.minimum(tl.maximum(tl.math.div_rn(xo, do_), -6.0), 6.0)
        packed = _e2m1_codes(ye) | (_e2m1_codes(yo) << 4)
        tl.store(p0 + row * (D // 2) + i, packed.to(tl.uint8), mask=ok)
        if CHANNEL:
            bt = tl.arange(0, BLOCK_P // 16)[:, None]
            b_ok = (bt < P // 16) & (de < D)
            b_off = ((page * (P // 16) + bt) * H + h) * D + de
            tl.store(p1 + b_off, bse, mask=b_ok)
            tl.store(p1 + b_off + 1, bso, mask=b_ok)
            tl.store(p2 + page * H + h + 0 * tok, gb + 0 * tok.to(tl.int16), mask=tok == 0)
        else:
            bj = tl.arange(0, BLOCK_D2 // 16)[None, :]
            b_ok = (tok < P) & (bj < D // 32)
            tl.store(p1 + row * (D // 32) + bj, bse, mask=b_ok)
            tl.store(p2 + row, gb, mask=tok < P)
