"""Decode attention over the strata: one query token per sequence, cold pages read by keys.

The decode-only twin of `kvstrata.radix.kernels.attend`'s kernel, driven by the same plan and the
same launch table (``DECODE_LAUNCH``, entries with ``by_blocks`` off): one program per (sequence, KV
head, split), its ``GROUP`` query heads padded to ``BLOCK_H`` rows (16, `tl.dot`'s minimum), so it
carries no query-block index, no causal mask and no loop over new tokens (the one new key is a
tile of its own). Cold keys come in tiles of ``BLOCK_N`` across pages, decoded as `_cold_tile` does
(codes with one scale per key straight into the dot, the key scale on the scores, the value scale on
the softmax weights), then the sink page, the ring rows and the new key in the last split.

``swap_ab`` (``SWAP``): the cold tiles are computed transposed, scores ``[BLOCK_N, BLOCK_H] = codes .
q^T`` and the accumulator ``[BLOCK_D, BLOCK_H] = v^T . p^T``, so the keys (64 or more) are the
product's M side: on Hopper a warp-group product (wgmma, M of 64) instead of 16-row products of which
a decode step fills only ``GROUP`` rows. The tail (sinks, ring, new key) runs untransposed.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvstrata.quant.kernel_decode import (
    f16_opaque,
    fp8_f16,
    fp8_pairs,
    int8_pairs,
    load_decoded,
    pow2_scale,
    value_tile_scales,
)
from kvstrata.radix.kernels.attend import (
    DECODE_POINTERS,
    STEP_INTS,
    _accumulate,
    _codes,
    _cold_tile,
    _online,
    _online_pow2_scaled,
    _raw_tile,
    _scores,
    _turned_tile,
    decode_program,
    merge_if_last,
)
from kvstrata.radix.kernels.jit import jit_unspecialized

# ``lazy_rescale``: the running max (base 2) moves, and the accumulator is rescaled, only when a tile's
# largest score passes it by more than this; until then weights reach at most 2**LAZY_GROWTH.
LAZY_GROWTH = tl.constexpr(8.0)


@triton.jit
def _grid(x, SHIFT: tl.constexpr, SMALL: tl.constexpr, MAGIC: tl.constexpr):
    """`fp8_grid` for a format of ``23 - SHIFT`` mantissa bits, least normal ``SMALL`` and subnormal
    spacing ``MAGIC * 2**-23 / 1.5``."""
    bits = x.to(tl.int32, bitcast=True)
    bits = bits + ((1 << (SHIFT - 1)) - 1) + ((bits >> SHIFT) & 1)
    normal = (bits & ~((1 << SHIFT) - 1)).to(tl.float32, bitcast=True)
    sub = (x + MAGIC) - MAGIC  # x + MAGIC has the subnormals' spacing as its ulp
    return tl.where(tl.abs(x) < SMALL, sub, normal)


@triton.jit
def fp8_grid(x, FMT: tl.constexpr):
    """float32 ``x`` rounded (to nearest even) to FP8 format ``FMT``'s grid (1 E4M3: 3 mantissa bits,
    normals from 2**-6; 2 E5M2: 2 bits, from 2**-14), as float32, subnormal spacing below the normals,
    so that the conversion to FP8 that follows is exact (no rounding left to it; Triton's interpreter
    rounds float32 to FP8 wrongly where the rounding carries into the exponent). No overflow handling:
    the callers scale ``x`` below the format's maximum."""
    if FMT == 1:  # noqa: SIM108  (constexpr branches of a Triton function)
        y = _grid(x, 20, 0.015625, 24576.0)  # 1.5 * 2**(-6 - 3 + 23)
    else:
        y = _grid(x, 21, 6.103515625e-05, 192.0)  # 1.5 * 2**(-14 - 2 + 23)
    return y


@triton.jit
def fp8_split(x, c, FMT: tl.constexpr):
    """``(hi, lo)``: ``x * c`` (``c`` a power of two) as two FP8 operands of format ``FMT`` with
    ``hi + lo`` within ``2**-(2M+2)`` of it relatively (``M`` mantissa bits: 2**-8 E4M3, 2**-6 E5M2)
    plus half the format's least subnormal (2**-10 / 2**-17) absolutely; exact for BF16 ``x`` with E4M3
    where ``x * c`` is at least 2**-2 (``hi`` takes 4 of its 8 significant bits, ``lo`` the rest)."""
    y = x * c
    hi = fp8_grid(y, FMT)
    lo = fp8_grid(y - hi, FMT)
    if FMT == 1:
        return hi.to(tl.float8e4nv), lo.to(tl.float8e4nv)
    else:
        return hi.to(tl.float8e5), lo.to(tl.float8e5)


@triton.jit
def fp8_operand_scale(x, FMT: tl.constexpr):
    """The power of two ``c`` that puts ``x``'s largest magnitude in the binade ``[2**TOP, 2**(TOP+1))``
    of FP8 format ``FMT`` (``TOP`` 7 for E4M3, whose largest value is 448; 14 for E5M2, 57344), built
    from the exponent bits; 1 for zero."""
    top = tl.max(tl.max(tl.abs(x), 1), 0)
    e = ((top.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    e = tl.where(top > 0, tl.minimum(tl.maximum(e, -100), 100), 7 if FMT == 1 else 14)
    return (((7 if FMT == 1 else 14) - e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def _fp8_bytes(p, row, d, d_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr):
    """``[N, BLOCK_D]`` FP8 codes at rows ``row`` as float8 operands of format ``FMT``, bit-cast."""
    x = _codes(p, row[:, None], d[None, :], d_ok, D, BLOCK_D, 0, tl.uint8, False)
    if FMT == 1:  # noqa: SIM108  (constexpr branches of a Triton function)
        x = x.to(tl.float8e4nv, bitcast=True)
    else:
        x = x.to(tl.float8e5, bitcast=True)
    return x


@triton.jit
def _cold_tile_t(
    qt,
    qct,
    acc,
    m_i,
    l_i,
    page,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    j,
    end,
    d,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
    HALVES: tl.constexpr,
):
    """`_cold_tile` transposed: ``qt``/``qct`` are q^T ``[BLOCK_D, BLOCK_H]`` (dot dtype / code dtype),
    ``acc`` is ``[BLOCK_D, BLOCK_H]``; scores and weights are ``[BLOCK_N, BLOCK_H]``."""
    ok = j < end
    tok = (j % P).to(tl.int64)
    row = (page * P + tok) * H + h
    d_ok = (d < D)[None, :]
    if K_FMT == 0:
        k = _codes(K0, row[:, None], d[None, :], d_ok, D, BLOCK_D, K_FMT, DOT_DTYPE, False)
        s = tl.dot(k, qt, input_precision=DOT_PREC)
    elif K_FMT <= 2:
        k = _codes(K0, row[:, None], d[None, :], d_ok, D, BLOCK_D, K_FMT, CODE_DTYPE, NORM_W)
        s = tl.dot(k, qct, input_precision=DOT_PREC)
        s = s * pow2_scale(tl.load(K1 + page * H + h))[:, None]
    else:
        k = load_decoded(K0, K1, K2, page[:, None], tok[:, None], h, d[None, :], ok[:, None] & d_ok,
                         ok[:, None], H, P, D, BLOCK_D, K_FMT, True).to(DOT_DTYPE)  # fmt: skip
        s = tl.dot(k, qt, input_precision=DOT_PREC)
    if MASKED:
        s = tl.where(ok[:, None], s, float("-inf"))
    p, alpha, m_new, l_i = _online(s, m_i, l_i, 0)
    if V_FMT == 0:
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, DOT_DTYPE, False, HALVES)
        pv = tl.dot(tl.trans(v), p.to(DOT_DTYPE), input_precision=DOT_PREC)
    elif V_FMT <= 4:
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, CODE_DTYPE, NORM_W, HALVES)
        vs, vo = value_tile_scales(V1, V2, row, V_FMT)
        if NORM_W:
            top = tl.max(tl.where(ok, vs, 1.1754943508222875e-38), 0)
            w = p * (vs * (1.0 / top))[:, None]
            pv = tl.dot(tl.trans(v), w.to(CODE_DTYPE), input_precision=DOT_PREC) * top
        else:
            pv = tl.dot(tl.trans(v), (p * vs[:, None]).to(CODE_DTYPE), input_precision=DOT_PREC)
        if V_FMT == 4:
            pv += tl.sum(p * vo[:, None], 0)[None, :]
    else:
        v = load_decoded(V0, V1, V2, page[:, None], tok[:, None], h, d[None, :], ok[:, None] & d_ok,
                         ok[:, None], H, P, D, BLOCK_D, V_FMT, False).to(DOT_DTYPE)  # fmt: skip
        pv = tl.dot(tl.trans(v), p.to(DOT_DTYPE), input_precision=DOT_PREC)
    return acc * alpha[None, :] + pv, m_new, l_i


@triton.jit
def _tail_tile(
    qd,
    acc,
    m_i,
    l_i,
    j,
    sink_len,
    ring_len,
    slot,
    ring,
    ring_row,
    b,
    h,
    H,
    d,
    SK,
    SV,
    RK,
    RV,
    KN,
    VN,
    D: tl.constexpr,
    P: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    DOT_PREC: tl.constexpr,
    RING_AHEAD: tl.constexpr,
    TURNED: tl.constexpr,
):
    """Keys ``j`` of the tail as one run: ``[0, sink_len)`` the sink page (slot ``slot``), then
    ``ring_len`` ring rows (their row ids at ``ring``; with ``RING_AHEAD`` given, ``ring_row``, loaded
    a tile ahead by `_tail_ring_rows`), then the new token, so a decode step's 16-key sink page, ring
    rows and one new key share tiles instead of taking a tile each. Each key row picks its source's
    pointer (sinks, ring and new rows share one dtype), so a tile's K and V load once. ``TURNED``: the
    products turned over, as the cold tiles with ``KEYS_AS_ROWS`` (``qd`` and ``acc`` ``[BLOCK_D,
    rows]``; scores ``k . q^T``, ``acc`` += ``v^T . p``): the keys the products' M side, the query rows
    their N, and the values read transposed for a transposing ldmatrix."""
    in_sink = j < sink_len
    in_ring = (j >= sink_len) & (j < sink_len + ring_len)
    if not RING_AHEAD:
        ring_row = _tail_ring_rows(ring, j, sink_len, ring_len)
    ring_row = ring_row * H + h
    new_row = (b * H + h + 0 * j).to(tl.int64)
    k_row = tl.where(in_ring, RK + ring_row * D, KN + new_row * D)
    v_row = tl.where(in_ring, RV + ring_row * D, VN + new_row * D)
    if HAS_SINKS:
        sink_row = (slot * P + j) * H + h
        k_row = tl.where(in_sink, SK + sink_row * D, k_row)
        v_row = tl.where(in_sink, SV + sink_row * D, v_row)
    seen = j <= sink_len + ring_len
    ok = seen[:, None] & (d < D)[None, :]
    k = tl.load(k_row[:, None] + d[None, :], mask=ok, other=0.0).to(qd.dtype)
    if TURNED:
        ok_t = (d < D)[:, None] & seen[None, :]
        vt = tl.load(v_row[None, :] + d[:, None], mask=ok_t, other=0.0).to(qd.dtype)
        acc, m_i, l_i = _turned_tile(k, vt, qd, seen[:, None], acc, m_i, l_i, DOT_PREC)
    else:
        v = tl.load(v_row[:, None] + d[None, :], mask=ok, other=0.0).to(qd.dtype)
        s = tl.where(seen[None, :], _scores(qd, qd, k, k, False, DOT_PREC), float("-inf"))
        p, alpha, m_i, l_i = _online(s, m_i, l_i)
        acc, _ = _accumulate(acc, acc, alpha, p, v, v, False, DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _tail_ring_rows(ring, j, sink_len, ring_len):
    """The ring row ids of tail keys ``j`` (`_tail_tile`; 0 for keys outside the ring), ``ring`` the
    sequence's row of ring row ids."""
    in_ring = (j >= sink_len) & (j < sink_len + ring_len)
    return tl.load(ring + j - sink_len, mask=in_ring, other=0).to(tl.int64)


@triton.jit
def _lazy_online_pow2(s, ks, e_bits, acc, m_i, l_i):
    """`attend._online_pow2_scaled` with a lazy rescale (FlashAttention-4's): the running max ``m_i``
    of ``s + e`` moves only when the tile's largest ``s + e`` passes it by more than `LAZY_GROWTH`,
    and only then are ``acc`` and ``l_i`` rescaled (a branch the whole program takes or skips: no
    multiply of the ``[rows, D]`` accumulator on the tiles that skip it, most of a long context's).
    Weights ``2**(s + e - m)`` stay at most ``2**LAZY_GROWTH`` (FP16-safe); the output and the
    log-sum-exp are the same for any ``m``. The scores are ``s * ks`` (``ks`` a key's scale), taken
    as explicit FMAs on both sides of the branch (a product before it would not fuse with the
    subtraction after it). Returns ``(weights, acc, m_i, l_i)``."""
    eb = tl.maximum(e_bits.to(tl.int32), 27)  # e = eb - 127 >= -100, as `_online_pow2_scaled`
    top = tl.max(tl.fma(s, ks[None, :], (eb - 127).to(tl.float32)[None, :]), 1)
    if tl.max(top - m_i, 0) > LAZY_GROWTH:
        m_new = tl.maximum(m_i, top)
        alpha = tl.exp2(m_i - m_new)
        acc = acc * alpha[:, None]
        l_i = l_i * alpha
        m_i = m_new
    p = tl.exp2(tl.fma(s, ks[None, :], -m_i[:, None]))
    w = p * (eb << 23).to(tl.float32, bitcast=True)[None, :]  # 2**e from its bits
    return w, acc, m_i, l_i + tl.sum(p, 1)


@triton.jit
def _fp8_operand(
    p, row, d, d_ok, D: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr, CODE_DTYPE: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """``[N, BLOCK_D]`` FP8 codes at rows ``row`` (``[N]``) as ``CODE_DTYPE`` dot operands: ``ASM``
    the raw bytes (`_codes` with format 0) converted by `fp8_f16`, else `_codes`' conversion (which
    Triton 3.6 moves past the operand's layout change, so the codes reach shared memory as bytes)."""
    if ASM:
        x = fp8_f16(_codes(p, row[:, None], d[None, :], d_ok, D, BLOCK_D, 0, tl.uint8, False), FMT == 2)
    else:
        x = _codes(p, row[:, None], d[None, :], d_ok, D, BLOCK_D, FMT, CODE_DTYPE, True)
    return x


@triton.jit
def _fp8_tile(
    qc,
    acc,
    m_i,
    l_i,
    page,
    K0,
    K1,
    V0,
    V1,
    j,
    end,
    d,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    CODES_ASM: tl.constexpr,
    LAZY: tl.constexpr,
):
    """A cold tile of FP8 keys and values (BF16 model, `attend._cold_tile`'s ``NORM_W`` and ``POW2_W``
    path) with pass 9's options: ``CODES_ASM`` value codes (1), or key and value codes (2), converted
    to FP16 by `fp8_f16` before the products (FP16 ``CODE_DTYPE`` on a GPU: `_fp8_operand`), and the
    softmax weights by `f16_opaque`; ``LAZY`` the softmax state by `_lazy_online_pow2`."""
    ok = j < end
    row = (page * P + (j % P).to(tl.int64)) * H + h
    d_ok = (d < D)[None, :]
    k = _fp8_operand(K0, row, d, d_ok, D, BLOCK_D, K_FMT, CODE_DTYPE, CODES_ASM == 2)
    s = tl.dot(qc, tl.trans(k), input_precision=DOT_PREC)
    if MASKED:
        s = tl.where(ok[None, :], s, float("-inf"))
    ks = pow2_scale(tl.load(K1 + page * H + h))  # > 0: masked scores stay -inf
    v = _fp8_operand(V0, row, d, d_ok, D, BLOCK_D, V_FMT, CODE_DTYPE, CODES_ASM > 0)
    if LAZY:
        w, acc, m_i, l_i = _lazy_online_pow2(s, ks, tl.load(V1 + row), acc, m_i, l_i)
    else:
        w, alpha, m_i, l_i = _online_pow2_scaled(s * ks[None, :], tl.load(V1 + row), m_i, l_i)
        acc = acc * alpha[:, None]
    if CODES_ASM > 0:
        w = f16_opaque(w)
    acc += tl.dot(w.to(CODE_DTYPE), v, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _fp8_dot_tile(
    qh,
    ql,
    kq,
    acc,
    m_i,
    l_i,
    page,
    K0,
    K1,
    V0,
    V1,
    j,
    end,
    d,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    W_UNIT: tl.constexpr,
    LAZY: tl.constexpr,
    SWAP: tl.constexpr,
):
    """A cold tile of FP8 keys and values (BF16 model, ``POW2_W`` weights) with FP8 tensor-core
    operands (``fp8_dot``): the key codes bit-cast to float8 straight into q.K^T against ``qh + ql``
    (`fp8_split` of q, made once a program; ``kq`` = the softmax scale over the split's power of two,
    joined to the key scale); ``FP8_DOT`` 2: the weights split the same way (in units of ``W_UNIT``,
    taken out after the loop) against the value codes bit-cast, else values converted to
    ``CODE_DTYPE`` as `_fp8_tile` does. ``SWAP``: scores ``[N, rows]`` (q^T operands, ``acc`` is
    ``[BLOCK_D, rows]``), so the keys are the product's M side (a warp group's product on sm_90)."""
    ok = j < end
    row = (page * P + (j % P).to(tl.int64)) * H + h
    d_ok = (d < D)[None, :]
    k = _fp8_bytes(K0, row, d, d_ok, D, BLOCK_D, K_FMT)
    ks = pow2_scale(tl.load(K1 + page * H + h)) * kq  # > 0: masked scores stay -inf
    if FP8_DOT == 2:
        v = _fp8_bytes(V0, row, d, d_ok, D, BLOCK_D, V_FMT)
    else:
        v = _fp8_operand(V0, row, d, d_ok, D, BLOCK_D, V_FMT, CODE_DTYPE, False)
    e_bits = tl.load(V1 + row)
    if SWAP:
        s = tl.dot(k, ql, tl.dot(k, qh, input_precision=DOT_PREC), input_precision=DOT_PREC)
        if MASKED:
            s = tl.where(ok[:, None], s, float("-inf"))
        w, alpha, m_i, l_i = _online_pow2_scaled(s * ks[:, None], e_bits, m_i, l_i, 0)
        acc = acc * alpha[None, :]
        if FP8_DOT == 2:
            wh, wl = fp8_split(w, W_UNIT, V_FMT)
            vt = tl.trans(v)
            acc = tl.dot(vt, wl, tl.dot(vt, wh, acc, input_precision=DOT_PREC), input_precision=DOT_PREC)
        else:
            acc += tl.dot(tl.trans(v), w.to(CODE_DTYPE), input_precision=DOT_PREC)
    else:
        kt = tl.trans(k)
        s = tl.dot(ql, kt, tl.dot(qh, kt, input_precision=DOT_PREC), input_precision=DOT_PREC)
        if MASKED:
            s = tl.where(ok[None, :], s, float("-inf"))
        if LAZY:
            w, acc, m_i, l_i = _lazy_online_pow2(s, ks, e_bits, acc, m_i, l_i)
        else:
            w, alpha, m_i, l_i = _online_pow2_scaled(s * ks[None, :], e_bits, m_i, l_i)
            acc = acc * alpha[:, None]
        if FP8_DOT == 2:
            wh, wl = fp8_split(w, W_UNIT, V_FMT)
            acc = tl.dot(wl, v, tl.dot(wh, v, acc, input_precision=DOT_PREC), input_precision=DOT_PREC)
        else:
            acc += tl.dot(w.to(CODE_DTYPE), v, input_precision=DOT_PREC)
    return acc, m_i, l_i


@triton.jit
def _fp8_pairs_tile(
    qa, qb, acc, acc1, m_i, l_i, page, K0, K1, V0, V1, j, end, d, h, H,
    P: tl.constexpr, D: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr, MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr, CODE_DTYPE: tl.constexpr, ASM: tl.constexpr, BITS_GIVEN: tl.constexpr,
    k_bits, v_bits, ROWS: tl.constexpr,
):  # fmt: skip
    """`attend._cold_tile`'s FP8 path (a BF16 model: FP16 code operands, ``POW2_W`` weights) with the
    value codes read as uint16 channel pairs (``value_pairs``): `fp8_pairs` turns them into the even
    and the odd channels' operands, the output accumulating in the halves ``acc`` (even channels) and
    ``acc1`` (odd), ``[rows, D/2]`` each; keys as `_cold_tile` reads them, against ``qa`` (q in
    ``CODE_DTYPE``). ``BITS_GIVEN``: the scale exponents were loaded a tile ahead (`_fp8_scale_bits`).

    ``ROWS`` (``keys_as_rows``): the products turned over, scores ``k . q^T`` ``[N, rows]`` over the
    even and odd channel halves (``qa``/``qb``: q's halves transposed, ``[D/2, rows]``), so that the
    query side is the products' N (8 columns for a group of 4, not 16 padded rows), the softmax along
    the keys (axis 0), the output ``v^T . w`` in transposed halves ``[D/2, rows]``. Key and value codes
    are then both read as channel pairs in ``[D/2, N]`` tiles, already the products' operand shape: so
    read, Triton 3.6 copies both ahead asynchronously and loads them by ldmatrix (sm_90: 567
    instructions a 32-key tile); read ``[N, D/2]`` and turned, one of them was loaded to registers,
    stored to shared memory and loaded again (645-712)."""
    ok = j < end
    row = (page * P + (j % P).to(tl.int64)) * H + h
    c = tl.arange(0, D // 2)
    u16 = tl.pointer_type(tl.uint16)
    keys: tl.constexpr = 0 if ROWS else 1  # the scores' axis of the keys
    if ROWS:
        at = row[None, :] * (D // 2) + c[:, None]  # [D/2, N]
        k0, k1 = fp8_pairs(tl.load(K0.to(u16) + at), K_FMT == 2, ASM, CODE_DTYPE)
        s = tl.dot(tl.trans(k0), qa, input_precision=DOT_PREC)
        s = tl.dot(tl.trans(k1), qb, s, input_precision=DOT_PREC)
        vt = tl.load(V0.to(u16) + at)
    else:
        k = _codes(K0, row[:, None], d[None, :], (d < D)[None, :], D, D, K_FMT, CODE_DTYPE, True)
        s = tl.dot(qa, tl.trans(k), input_precision=DOT_PREC)
        vt = tl.load(V0.to(u16) + row[:, None] * (D // 2) + c[None, :])
    if not BITS_GIVEN:
        k_bits = tl.load(K1 + page * H + h)
        v_bits = tl.load(V1 + row)
    s = s * tl.expand_dims(pow2_scale(k_bits), 1 - keys)
    if MASKED:
        s = tl.where(tl.expand_dims(ok, 1 - keys), s, float("-inf"))
    v0, v1 = fp8_pairs(vt, V_FMT == 2, ASM, CODE_DTYPE)
    w, alpha, m_i, l_i = _online_pow2_scaled(s, v_bits, m_i, l_i, keys)
    w = w.to(CODE_DTYPE)
    if ROWS:
        acc = tl.dot(v0, w, acc * alpha[None, :], input_precision=DOT_PREC)
        acc1 = tl.dot(v1, w, acc1 * alpha[None, :], input_precision=DOT_PREC)
    else:
        acc = acc * alpha[:, None] + tl.dot(w, v0, input_precision=DOT_PREC)
        acc1 = acc1 * alpha[:, None] + tl.dot(w, v1, input_precision=DOT_PREC)
    return acc, acc1, m_i, l_i


@triton.jit
def _int8_rows_tile(
    q0t, q1t, acc, acc1, m_i, l_i, page, K0, K1, V0, V1, j, end, h, H,
    P: tl.constexpr, D: tl.constexpr, MASKED: tl.constexpr, DOT_PREC: tl.constexpr, CODE_DTYPE: tl.constexpr,
    ASM: tl.constexpr,
):  # fmt: skip
    """A cold tile of int8 keys and values (``int8_rows``): `_fp8_pairs_tile`'s ``ROWS`` layout, codes
    read as uint16 channel pairs in ``[D/2, N]`` tiles and made FP16 by `int8_pairs`, scores ``k .
    q^T`` over the channel halves, the output ``v^T . w`` in transposed halves ``acc``/``acc1``. All
    the tile's keys lie in one page (the launch's tiles are page-aligned and at most a page), so the
    keys' per-channel scales are one float32 vector a tile, put on the decoded codes in ``CODE_DTYPE``
    (one FP16 pair product a channel pair; folded into the query instead, ``q * s``, the compiled loop
    moved the scaled query through shared memory one element at a time). The values' per-token scales
    go on the softmax weights, over the tile's largest so that the FP16 weights stay normal, and the
    tile's product is taken back to the accumulator's units after. ``MASKED`` is never true here
    (splits are whole pages, so a page of whole tiles leaves no partial tile); the branch serves the
    kernel's masked call site, which compiles for every layout."""
    ok = j < end
    row = (page * P + (j % P).to(tl.int64)) * H + h
    c = tl.arange(0, D // 2)
    u16 = tl.pointer_type(tl.uint16)
    at = row[None, :] * (D // 2) + c[:, None]  # [D/2, N]
    scales = K1 + (tl.max(page, 0) * H + h) * D  # the tile's page (a masked key reads page 0)
    k0, k1 = int8_pairs(tl.load(K0.to(u16) + at), ASM, CODE_DTYPE)
    k0 = k0 * tl.load(scales + 2 * c).to(CODE_DTYPE)[:, None]
    k1 = k1 * tl.load(scales + 2 * c + 1).to(CODE_DTYPE)[:, None]
    s = tl.dot(tl.trans(k0), q0t, input_precision=DOT_PREC)
    s = tl.dot(tl.trans(k1), q1t, s, input_precision=DOT_PREC)
    vs = tl.load(V1 + row)
    if MASKED:
        s = tl.where(ok[:, None], s, float("-inf"))
        vs = tl.where(ok, vs, 0.0)
    p, alpha, m_i, l_i = _online(s, m_i, l_i, 0)
    top = tl.max(vs, 0) + 1.1754943508222875e-38
    w = (p * (vs * (1.0 / top))[:, None]).to(CODE_DTYPE)
    v0, v1 = int8_pairs(tl.load(V0.to(u16) + at), ASM, CODE_DTYPE)
    acc = acc * alpha[None, :] + tl.dot(v0, w, input_precision=DOT_PREC) * top
    acc1 = acc1 * alpha[None, :] + tl.dot(v1, w, input_precision=DOT_PREC) * top
    return acc, acc1, m_i, l_i


@triton.jit
def _decode_cold_tile(
    qd,
    qc,
    qh,
    ql,
    kq,
    q0t,
    q1t,
    acc,
    acc1,
    m_i,
    l_i,
    page,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    j,
    end,
    d,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
    HALVES: tl.constexpr,
    SWAP: tl.constexpr,
    CODES_ASM: tl.constexpr,
    LAZY: tl.constexpr,
    FP8_DOT: tl.constexpr,
    W_UNIT: tl.constexpr,
    BITS_AHEAD: tl.constexpr,
    k_bits,
    v_bits,
    VALUE_PAIRS: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,
    PAIRS_ASM: tl.constexpr,
    INT8_ROWS: tl.constexpr,
):
    """One cold tile of the decode loop: `_fp8_dot_tile` with ``FP8_DOT`` (``fp8_dot``), `_fp8_tile`
    where pass 9's options apply (``CODES_ASM`` or
    ``LAZY``, set by `decode_options` for FP8 keys and values only), `_cold_tile_t` (``SWAP``) or
    `_cold_tile` with the decode module's value scales (``POW2_W``), so the full tiles and the masked
    last one share a call. ``BITS_AHEAD``: `_cold_tile`'s scale exponents ``k_bits`` / ``v_bits`` were
    loaded a tile ahead (`_fp8_scale_bits`). Pass 13: `_fp8_pairs_tile` (``VALUE_PAIRS``, against ``q0t``,
    q in ``CODE_DTYPE``; ``KEYS_AS_ROWS``, against q's transposed halves ``q0t``/``q1t``), which alone
    uses ``acc1``. ``INT8_ROWS``: `_int8_rows_tile` (int8 keys and values, with ``KEYS_AS_ROWS``' q halves
    and accumulator)."""
    if INT8_ROWS:
        acc, acc1, m_i, l_i = _int8_rows_tile(
            q0t, q1t, acc, acc1, m_i, l_i, page, K0, K1, V0, V1, j, end, h, H, P, D, MASKED, DOT_PREC,
            CODE_DTYPE, PAIRS_ASM,
        )  # fmt: skip
    elif VALUE_PAIRS or KEYS_AS_ROWS:
        acc, acc1, m_i, l_i = _fp8_pairs_tile(
            q0t, q1t, acc, acc1, m_i, l_i, page, K0, K1, V0, V1, j, end, d, h, H, P, D, K_FMT, V_FMT,
            MASKED, DOT_PREC, CODE_DTYPE, PAIRS_ASM, BITS_AHEAD, k_bits, v_bits, KEYS_AS_ROWS,
        )  # fmt: skip
    elif FP8_DOT > 0:
        acc, m_i, l_i = _fp8_dot_tile(
            qh, ql, kq, acc, m_i, l_i, page, K0, K1, V0, V1, j, end, d, h,
            H, P, D, BLOCK_D, K_FMT, V_FMT, MASKED, DOT_PREC, CODE_DTYPE, FP8_DOT, W_UNIT, LAZY, SWAP,
        )  # fmt: skip
    elif CODES_ASM > 0 or LAZY:
        acc, m_i, l_i = _fp8_tile(
            qc, acc, m_i, l_i, page, K0, K1, V0, V1, j, end, d, h,
            H, P, D, BLOCK_D, K_FMT, V_FMT, MASKED, DOT_PREC, CODE_DTYPE, CODES_ASM, LAZY,
        )  # fmt: skip
    elif SWAP:
        acc, m_i, l_i = _cold_tile_t(
            qd, qc, acc, m_i, l_i, page, K0, K1, K2, V0, V1, V2, j, end, d, h,
            H, P, D, BLOCK_D, K_FMT, V_FMT, MASKED, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W, HALVES,
        )  # fmt: skip
    else:
        acc, m_i, l_i = _cold_tile(
            qd, qc, acc, m_i, l_i, page, K0, K1, K2, V0, V1, V2, j, end, d, h,
            H, P, D, BLOCK_D, K_FMT, V_FMT, MASKED, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W, HALVES, True,
            BITS_AHEAD, k_bits, v_bits,
        )  # fmt: skip
    return acc, acc1, m_i, l_i


@triton.jit
def _fp8_scale_bits(K1, V1, page, j, h, H, P: tl.constexpr):
    """The scale exponents of a tile of FP8 history, keys ``j`` in pages ``page``: the key's (one a
    page and head) and the value's (one a token and head), uint8 each. Single bytes, which Triton's
    pipeliner does not copy ahead (an async copy moves 4 bytes or more): with ``BITS_AHEAD`` the
    kernel loads them a tile ahead, beside the page-table entries (H200: the plain loads were the
    wide loop's largest stall, docs pass 11)."""
    row = (page * P + (j % P).to(tl.int64)) * H + h
    return tl.load(K1 + page * H + h), tl.load(V1 + row)


@jit_unspecialized(ints=STEP_INTS, pointers=DECODE_POINTERS)  # `attend._attend_kernel`'s and COUNT
def _decode_kernel(
    Q,
    KN,
    VN,
    OUT,
    PO,
    PL,
    PT,
    COLD_LEN,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    ST,
    SINK_OK,
    SK,
    SV,
    RR,
    RING_LEN,
    RK,
    RV,
    qk_scale,
    H,
    pt_stride,
    rr_stride,
    pages_per_split,
    num_splits,
    tail_split,
    GROUP: tl.constexpr,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    P: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    SPLIT: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    SWAP: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
    HALVES: tl.constexpr,
    MERGED_TAIL: tl.constexpr,
    RING_AHEAD: tl.constexpr,
    CODES_ASM: tl.constexpr,
    LAZY_RESCALE: tl.constexpr,
    FP8_DOT: tl.constexpr,
    W_UNIT: tl.constexpr,
    BITS_AHEAD: tl.constexpr,
    VALUE_PAIRS: tl.constexpr,
    PAIRS_ASM: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,
    INT8_ROWS: tl.constexpr,
    HEADS_TOGETHER: tl.constexpr,
    TAIL_T: tl.constexpr,
    COUNT,
    MERGE_S: tl.constexpr,
    MERGE_G: tl.constexpr,
):
    b, h = decode_program(H, HEADS_TOGETHER)
    split = tl.program_id(2)
    r = tl.arange(0, BLOCK_H)
    row_ok = r < GROUP
    q_row = (b * H + h).to(tl.int64) * GROUP + r  # query head h * GROUP + r of token b
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(tl.float32)
    qh = q
    ql = q
    kq = qk_scale
    if FP8_DOT > 0:  # q (the model's BF16) as two FP8 operands, the scales on the key scale
        c = fp8_operand_scale(q, K_FMT)
        qh, ql = fp8_split(q, c, K_FMT)
        kq = qk_scale / c
    q = q * qk_scale  # the softmax scale (base 2) folded in
    qd = q.to(DOT_DTYPE)
    qc = q.to(CODE_DTYPE)  # the operand of 8-bit key codes
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    if SWAP:
        qd = tl.trans(qd)
        qc = tl.trans(qc)
        qh = tl.trans(qh)
        ql = tl.trans(ql)
        acc = tl.zeros([BLOCK_D, BLOCK_H], dtype=tl.float32)
    elif KEYS_AS_ROWS:  # the cold tiles' output in transposed channel halves (odd ones in acc1)
        acc = tl.zeros([BLOCK_D // 2, BLOCK_H], dtype=tl.float32)
    elif VALUE_PAIRS:  # the cold tiles' output in channel halves: even channels here, odd in acc1
        acc = tl.zeros([BLOCK_H, BLOCK_D // 2], dtype=tl.float32)
    else:
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    if KEYS_AS_ROWS:
        acc1 = tl.zeros([BLOCK_D // 2, BLOCK_H], dtype=tl.float32)
        c0 = 2 * tl.arange(0, BLOCK_D // 2)  # q's even channels, then its odd ones: k . q^T's operands
        q_at = Q + q_row[None, :] * D
        q0t = tl.load(q_at + c0[:, None], mask=row_ok[None, :], other=0.0).to(tl.float32) * qk_scale
        q1t = tl.load(q_at + c0[:, None] + 1, mask=row_ok[None, :], other=0.0).to(tl.float32) * qk_scale
        q0t = q0t.to(CODE_DTYPE)
        q1t = q1t.to(CODE_DTYPE)
    else:
        acc1 = tl.zeros([BLOCK_H, BLOCK_D // 2], dtype=tl.float32)  # VALUE_PAIRS' odd channels
        q0t = qc
        q1t = qc

    # Cold keys of this split: full tiles unmasked, then the partial last one masked.
    n_cold = tl.load(COLD_LEN + b)
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, n_cold)
    end = hi * P
    full = lo * P + tl.maximum(hi - lo, 0) * P // BLOCK_N * BLOCK_N
    n = tl.arange(0, BLOCK_N)
    pt = PT + b * pt_stride
    k_bits = 0  # FP8 scale exponents a tile ahead (BITS_AHEAD), else loaded in the tile
    v_bits = 0
    if PREFETCH:  # page-table entries a tile ahead, so a tile's code loads never wait on them
        page = tl.load(pt + (lo * P + n) // P, mask=lo * P + n < end, other=0).to(tl.int64)
        if BITS_AHEAD:
            k_bits, v_bits = _fp8_scale_bits(K1, V1, page, lo * P + n, h, H, P)
    for j0 in range(lo * P, full, BLOCK_N):
        if PREFETCH:
            ahead = j0 + BLOCK_N + n
            page_ahead = tl.load(pt + ahead // P, mask=ahead < end, other=0).to(tl.int64)
            if BITS_AHEAD:
                k_ahead, v_ahead = _fp8_scale_bits(K1, V1, page_ahead, ahead, h, H, P)
        else:
            page = tl.load(pt + (j0 + n) // P).to(tl.int64)
        acc, acc1, m_i, l_i = _decode_cold_tile(
            qd, qc, qh, ql, kq, q0t, q1t, acc, acc1, m_i, l_i, page, K0, K1, K2, V0, V1, V2, j0 + n, end, d,
            h, H, P, D, BLOCK_D, K_FMT, V_FMT, False, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W, HALVES, SWAP,
            CODES_ASM, LAZY_RESCALE, FP8_DOT, W_UNIT, BITS_AHEAD, k_bits, v_bits, VALUE_PAIRS, KEYS_AS_ROWS,
            PAIRS_ASM, INT8_ROWS,
        )  # fmt: skip
        if PREFETCH:
            page = page_ahead
            if BITS_AHEAD:
                k_bits = k_ahead
                v_bits = v_ahead
    if full < end:
        if not PREFETCH:
            page = tl.load(pt + (full + n) // P, mask=full + n < end, other=0).to(tl.int64)
        acc, acc1, m_i, l_i = _decode_cold_tile(
            qd, qc, qh, ql, kq, q0t, q1t, acc, acc1, m_i, l_i, page, K0, K1, K2, V0, V1, V2, full + n, end, d,
            h, H, P, D, BLOCK_D, K_FMT, V_FMT, True, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W, HALVES, SWAP,
            CODES_ASM, LAZY_RESCALE, FP8_DOT, W_UNIT, BITS_AHEAD, k_bits, v_bits, VALUE_PAIRS, KEYS_AS_ROWS,
            PAIRS_ASM, INT8_ROWS,
        )  # fmt: skip
    if FP8_DOT == 2:  # the weights' operands were in units of W_UNIT
        acc = acc * (1.0 / W_UNIT)
    if KEYS_AS_ROWS:
        acc = tl.trans(acc)
        acc1 = tl.trans(acc1)
    if VALUE_PAIRS or KEYS_AS_ROWS:  # channel 2i from the even half, 2i + 1 from the odd one
        acc = tl.reshape(tl.join(acc, acc1), [BLOCK_H, BLOCK_D])
    if SWAP:
        acc = tl.trans(acc)
        qd = tl.trans(qd)
    if HALVES:  # values' channels back in order: column 2i + t holds channel t * BLOCK_D / 2 + i
        acc = tl.permute(tl.reshape(acc, [BLOCK_H, BLOCK_D // 2, 2]), (0, 2, 1))
        acc = tl.reshape(acc, [BLOCK_H, BLOCK_D])

    if split == tail_split:  # sinks, ring and the new key: the last split of the text pool's pass
        sink_len = 0
        slot = 0
        if HAS_SINKS:
            sink_len = tl.load(SINK_OK + b) * P  # P keys when the sequence has a sink page, else 0
            slot = tl.load(ST + b).to(tl.int64)
        ring_len = tl.load(RING_LEN + b)
        if MERGED_TAIL:  # one run of keys: sink page, ring rows, new key
            ring = RR + b * rr_stride
            if RING_AHEAD:  # noqa: SIM108  (constexpr branches of a Triton function) each tile's ring
                ring_row = _tail_ring_rows(ring, n, sink_len, ring_len)  # row ids a tile ahead
            else:
                ring_row = 0
            if TAIL_T:  # the query and output turned over for the tail's products, [BLOCK_D, rows]
                acc = tl.trans(acc)
                qt = tl.trans(qd)
            else:
                qt = qd
            for j0 in range(0, sink_len + ring_len + 1, BLOCK_N):
                if RING_AHEAD:
                    row_ahead = _tail_ring_rows(ring, j0 + BLOCK_N + n, sink_len, ring_len)
                acc, m_i, l_i = _tail_tile(
                    qt, acc, m_i, l_i, j0 + n, sink_len, ring_len, slot, ring, ring_row, b, h, H, d,
                    SK, SV, RK, RV, KN, VN, D, P, HAS_SINKS, DOT_PREC, RING_AHEAD, TAIL_T,
                )  # fmt: skip
                if RING_AHEAD:
                    ring_row = row_ahead
            if TAIL_T:
                acc = tl.trans(acc)
        else:
            for j0 in range(0, sink_len, BLOCK_N):
                ok = j0 + n < sink_len
                acc, _, m_i, l_i = _raw_tile(
                    qd, qd, acc, acc, m_i, l_i, SK, SV, (slot * P + j0 + n) * H + h, ok, ok[None, :],
                    d, d, d, d, D, False, False, DOT_PREC,
                )  # fmt: skip
            for j0 in range(0, ring_len, BLOCK_N):
                ok = j0 + n < ring_len
                ring_row = tl.load(RR + b * rr_stride + j0 + n, mask=ok, other=0).to(tl.int64)
                acc, _, m_i, l_i = _raw_tile(
                    qd, qd, acc, acc, m_i, l_i, RK, RV, ring_row * H + h, ok, ok[None, :],
                    d, d, d, d, D, False, False, DOT_PREC,
                )  # fmt: skip
            ok = n < 1
            acc, _, m_i, l_i = _raw_tile(
                qd, qd, acc, acc, m_i, l_i, KN, VN, (b + n).to(tl.int64) * H + h, ok, ok[None, :],
                d, d, d, d, D, False, False, DOT_PREC,
            )  # fmt: skip

    if SPLIT:
        has = l_i > 0
        inv = 1.0 / tl.where(has, l_i, 1.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_at = PO + (q_row * num_splits + split)[:, None] * D
        tl.store(PL + q_row * num_splits + split, lse, mask=row_ok)
    else:
        inv = 1.0 / l_i
        o_at = OUT + q_row[:, None] * D
    tl.store(o_at + d[None, :], (acc * inv[:, None]).to(o_at.dtype.element_ty),
             mask=row_ok[:, None] & d_ok[None, :])  # fmt: skip
    if MERGE_S > 0:  # the last split of this sequence and KV head merges them all into OUT
        merge_if_last(COUNT, PO, PL, OUT, b, h, H, num_splits, GROUP, D, MERGE_G, MERGE_S, BLOCK_D)


def halves_apply(meta: dict) -> bool:
    """Whether the ``halves`` layout applies: 8-bit values (codes loaded by `_codes`; raw BF16 values in
    it load 16-bit elements one by one on sm_90), a power-of-two head_dim of 32 or more."""
    return meta["V_FMT"] in (1, 2, 3, 4) and meta["BLOCK_D"] == meta["D"] >= 32


def decode_options(group: int, launch: dict, one_dtype: bool, meta: dict) -> dict:
    """`_decode_kernel`'s keyword arguments: ``meta`` the constexprs it shares with `_attend_kernel`;
    ``launch`` the `DECODE_LAUNCH` entry (``block_n``, ``num_warps``, ``num_stages``, ``prefetch``,
    ``swap_ab``, ``halves``: value codes in `_codes`' channel-pair layout where `halves_apply`,
    ``maxnreg``: a register cap per thread for coded history, so more programs fit an SM, or None;
    ``bits_ahead`` (absent: on): with ``prefetch``, FP8 scale exponents a tile ahead too (`bits_ahead`);
    ``merged_tail``: the sink page, ring rows and new key as one run of tiles, where ``one_dtype``:
    the step's K/V, the ring and the sinks share a dtype); ``ring_ahead`` (with the merged tail; absent:
    off): each tail tile's ring row ids loaded a tile ahead, so that its K/V copies need not wait for
    them (pass 17); ``tail_keys_as_rows`` (with the merged tail; absent: off): its tiles' products
    turned over (`_tail_tile`, pass 19). Pass 9, FP8 keys and values of a BF16 model
    only (`fp8_options`): ``codes_asm`` and ``lazy_rescale``; pass 13, where `pairs_apply`:
    ``value_pairs``, value codes as uint16 channel pairs (`_fp8_pairs_tile`), and ``keys_as_rows``, key
    and value codes so, the products turned over (`_fp8_pairs_tile`; the query rows padded to 8, not
    16); with int8 keys and values where `int8_rows_apply`, `_int8_rows_tile` (``INT8_ROWS``).
    ``heads_together``: program ids remapped so that consecutive programs are one sequence's KV
    heads (as `decode4`'s). The runtime arguments are
    `_attend_kernel`'s without ``T``, its grid (sequences, KV heads, splits); `attend.merge_options`
    adds the split merge's (``COUNT`` by keyword, ``MERGE_S``, ``MERGE_G``)."""
    swap = launch.get("swap_ab", False)
    halves = bool(launch.get("halves")) and halves_apply(meta)
    fp8 = fp8_options(launch, meta, swap, halves)
    wanted = bool(launch["prefetch"] and launch.get("bits_ahead", True))
    ahead = wanted and bits_ahead(meta, fp8, swap, halves)
    pairs_ok = pairs_apply(meta, fp8, swap, halves)
    int8_wanted = bool(launch.get("int8_rows") and launch.get("keys_as_rows"))
    int8 = int8_wanted and int8_rows_apply(meta, launch["block_n"], swap, halves)
    rows = (bool(launch.get("keys_as_rows")) and pairs_ok) or int8
    pairs = bool(launch.get("value_pairs")) and pairs_ok and not rows  # rows read values so already
    options = dict(
        meta,
        GROUP=group,
        BLOCK_H=max(8 if rows else 16, triton.next_power_of_2(group)),
        BLOCK_N=launch["block_n"],
        PREFETCH=launch["prefetch"],
        SWAP=swap,
        HALVES=halves,
        MERGED_TAIL=launch.get("merged_tail", True) and one_dtype,
        RING_AHEAD=bool(launch.get("ring_ahead")),  # read by the merged tail only
        **fp8,
        BITS_AHEAD=ahead,
        VALUE_PAIRS=pairs,
        PAIRS_ASM=(pairs or rows) and meta["CODE_DTYPE"] == tl.float16,
        KEYS_AS_ROWS=rows,
        INT8_ROWS=int8,
        HEADS_TOGETHER=bool(launch.get("heads_together")),
        TAIL_T=bool(launch.get("tail_keys_as_rows")),  # read by the merged tail only
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
    )
    if launch.get("maxnreg") and (meta["K_FMT"], meta["V_FMT"]) != (0, 0):  # coded history only
        options["maxnreg"] = launch["maxnreg"]
    return options


def int8_rows_apply(meta: dict, block_n: int, swap: bool, halves: bool) -> bool:
    """Whether ``keys_as_rows`` reads int8 history by `_int8_rows_tile`: symmetric int8 keys and values
    (format 3) in the plain layout, a power-of-two head_dim of 32 or more, and tiles that each lie in
    one page (``block_n`` keys, a divisor of the page size), so that a tile has one key-scale vector."""
    plain = not (swap or halves)
    return (
        meta["K_FMT"] == meta["V_FMT"] == 3
        and plain
        and meta["BLOCK_D"] == meta["D"] >= 32
        and meta["P"] % block_n == 0
    )


def pairs_apply(meta: dict, fp8: dict, swap: bool, halves: bool) -> bool:
    """Whether ``value_pairs`` applies: `bits_ahead`'s tile (FP8 keys and values of a BF16 model, plain
    layout) at a power-of-two head_dim of 32 or more (halves of 16 channels or more: a product's N)."""
    return bits_ahead(meta, fp8, swap, halves) and meta["BLOCK_D"] == meta["D"] >= 32


def bits_ahead(meta: dict, fp8: dict, swap: bool, halves: bool) -> bool:
    """Whether the tile is `_cold_tile`'s for FP8 keys and values with power-of-two value scales in the
    softmax exponent (a BF16 model, none of pass 9's or 10's FP8 options, plain layout), whose scale
    exponents ``prefetch`` then loads a tile ahead (`_fp8_scale_bits`)."""
    plain = not (swap or halves or fp8["CODES_ASM"] or fp8["LAZY_RESCALE"] or fp8["FP8_DOT"])
    return meta["K_FMT"] in (1, 2) and meta["V_FMT"] in (1, 2) and meta["NORM_W"] and plain


CODES_ASM = {False: 0, "values": 1, True: 2}  # a launch's ``codes_asm``: `_fp8_tile`'s ``CODES_ASM``
FP8_DOT = {False: 0, "keys": 1, True: 2}  # a launch's ``fp8_dot``: `_fp8_dot_tile`'s ``FP8_DOT``


def fp8_options(launch: dict, meta: dict, swap: bool, halves: bool) -> dict:
    """``CODES_ASM``, ``LAZY_RESCALE``, ``FP8_DOT`` and ``W_UNIT`` of `_decode_kernel` for FP8 keys and
    values with normalised weights (a BF16 model); off elsewhere. The launch's ``codes_asm``
    (`CODES_ASM`: ``"values"`` value codes, True key and value codes converted by PTX; FP16 code
    operands, so on a GPU only, under the interpreter the plain conversion runs) and ``lazy_rescale``,
    in the plain layout (not ``swap_ab`` or ``halves``). ``fp8_dot`` (`FP8_DOT`; not with ``halves``,
    nor with ``codes_asm``, which it replaces): ``"keys"`` q.K^T on FP8 operands (q split in two), True
    P.V too (the weights split, in units of ``W_UNIT``: the weights' largest possible value, 1 or
    2**`LAZY_GROWTH` with ``lazy_rescale``, at the format's top binade); with ``swap_ab`` too (no lazy
    rescale there)."""
    fp8 = meta["K_FMT"] in (1, 2) and meta["V_FMT"] in (1, 2) and meta["NORM_W"] and not halves
    dot = FP8_DOT[launch.get("fp8_dot", False)] if fp8 else 0
    plain = fp8 and not swap
    asm = plain and meta["CODE_DTYPE"] == tl.float16 and not dot
    lazy = plain and bool(launch.get("lazy_rescale"))
    top = 2.0 ** ((7 if meta["V_FMT"] == 1 else 14) + 1)  # the format's top binade's end
    return dict(
        CODES_ASM=CODES_ASM[launch.get("codes_asm", False)] if asm else 0,
        LAZY_RESCALE=lazy,
        FP8_DOT=dot,
        W_UNIT=top / (2.0**LAZY_GROWTH.value if lazy else 1.0) if dot == 2 else 1.0,
    )
