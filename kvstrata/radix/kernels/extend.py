"""Extend attention over the strata in the flash-attention loop shape (``EXTEND_LAUNCH`` ``module``
"extend"): several new tokens a sequence over raw (BF16/FP16/FP32) or FP8 history.

The extend-only twin of `kvstrata.radix.kernels.attend`'s kernel, driven by the same plan and launch
table, with the same grid (query blocks of ``BLOCK_M`` (token, query head) rows per sequence, KV
heads, splits), the same runtime arguments and the same order of keys: cold pages by keys across
pages, the sink page, the ring rows, then the new tokens. What differs is the loop body, shaped after
the sm_90 code Triton 3.6 compiles for it (docs/kernels-h200.md, pass 9):

- q enters the products as the model gave it; the softmax scale (base 2) multiplies inside the
  exponent's subtraction (a fused multiply-add an element) and each row's maximum. q's operand then
  stays in shared memory for the warp-group product (BF16, 128 x 64 tiles: 215 registers instead of
  250), which leaves room for 128-key tiles without spills in the loop.
- P.V accumulates into the rescaled output inside the product (``tl.dot(p, v, acc * alpha)``).
- FP8 values: the power-of-two value scales join the softmax exponent (as `attend._online_pow2_scaled`)
  instead of a cross-warp maximum of the tile's scales and two more passes over the output; with
  ``prefetch`` the FP8 scale bytes load a tile ahead with the page-table entries.
- New tokens: the tiles every query row of the block sees in full (keys before the block's first
  token) run without a causal mask; only the tiles on the diagonal are masked.

Cold 8-bit codes with per-channel scales (int8 keys) and 4-bit codes keep the attend kernel
(`applies`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvstrata.quant.kernel_decode import pow2_scale
from kvstrata.radix.kernels.attend import (
    FP8_FORMATS,
    STEP_INTS,
    STEP_POINTERS,
    _codes,
    _out_rows,
)
from kvstrata.radix.kernels.jit import jit_unspecialized


def applies(k_fmt: int, v_fmt: int) -> bool:
    """This kernel reads the layer: keys and values raw (format 0) or FP8 codes with one scale a key."""
    return all(f == 0 or f in FP8_FORMATS for f in (k_fmt, v_fmt))


def extend_options(group: int, block_m: int, launch: dict, meta: dict) -> dict:
    """`_flash_extend_kernel`'s keyword arguments: ``meta`` the constexprs it shares with
    `attend._attend_kernel`, ``launch`` the `EXTEND_LAUNCH` entry (``block_n``, ``num_warps``,
    ``num_stages``, ``prefetch``; ``late_blocks_first``: a sequence's query blocks start last block
    first, the causal chunk's heaviest programs (most new-token tiles) before its lightest, so that
    the light ones fill the last wave; off: on the H200, BF16, a 2K chunk over 30K tokens, 2.49 ms
    against 2.30, docs/kernels-h200.md pass 13). Its runtime arguments and grid are
    `attend._extend_kernel`'s."""
    return dict(
        meta,
        GROUP=group,
        BLOCK_M=block_m,
        BLOCK_N=launch["block_n"],
        PREFETCH=launch["prefetch"],
        LATE_FIRST=bool(launch.get("late_blocks_first")),
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
    )


@triton.jit
def _weigh(s, sc, acc, m_i, l_i, v, e_bits, POW2: tl.constexpr, DOT_PREC: tl.constexpr):
    """One tile's online softmax (base 2) of the scores ``s * sc`` and ``acc * alpha + w . v``, the
    product accumulating into the rescaled output. The scale multiplies inside the exponent's
    subtraction (one fused multiply-add an element) and on each row's maximum, so q enters the
    products as the model gave it. ``POW2``: ``e_bits`` (``[N]`` uint8 exponents) are the values'
    power-of-two scales, joined to the softmax exponent as `attend._online_pow2_scaled` does (the
    weights ``2**(x + e - m)`` stay at most 1, the sums add ``2**(x - m)``; ``e`` clamped at -100)."""
    if POW2:
        eb = tl.maximum(e_bits.to(tl.int32), 27)  # e = eb - 127 >= -100
        m_new = tl.maximum(m_i, tl.max(s * sc + (eb - 127).to(tl.float32)[None, :], 1))
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * sc)
    p = tl.exp2(s * sc - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    if POW2:
        p = p * (eb << 23).to(tl.float32, bitcast=True)[None, :]  # times 2**e, from its bits
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None], input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _scales(K1, V1, page, j, h, H, P: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr):
    """The FP8 scale bytes of cold keys ``j`` in pages ``page``: the key exponent of each key's page
    and head, the value exponent of each key (uint8, ``[N]``); ``page`` itself in place of the raw
    formats' (nothing loaded)."""
    ks = page
    ve = page
    if K_FMT != 0:
        ks = tl.load(K1 + page * H + h)
    if V_FMT != 0:
        ve = tl.load(V1 + (page * P + (j % P).to(tl.int64)) * H + h)
    return ks, ve


@triton.jit
def _cold(
    qd,
    qc,
    qk_scale,
    acc,
    m_i,
    l_i,
    page,
    ks,
    ve,
    K0,
    V0,
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
    DIRECT: tl.constexpr,
):
    """One tile of cold keys ``j`` (``[N]`` positions in the sequence's cold pages; ``MASKED``: those
    at or past ``end`` are padding) in pages ``page`` (``[N]`` int64), ``ks``/``ve`` their FP8 scale
    bytes (`_scales`). Raw codes enter the dots as ``DOT_DTYPE``, FP8 codes as ``CODE_DTYPE`` (``qc``
    is q in it; ``DIRECT``: converted straight to it, `attend._codes`) with the page's key exponent on
    the score columns."""
    row = (page * P + (j % P).to(tl.int64)) * H + h
    d_ok = (d < D)[None, :]
    if K_FMT == 0:
        k = _codes(K0, row[:, None], d[None, :], d_ok, D, BLOCK_D, K_FMT, DOT_DTYPE, False)
        s = tl.dot(qd, tl.trans(k), input_precision=DOT_PREC)
        sc = qk_scale
    else:
        k = _codes(K0, row[:, None], d[None, :], d_ok, D, BLOCK_D, K_FMT, CODE_DTYPE, DIRECT)
        s = tl.dot(qc, tl.trans(k), input_precision=DOT_PREC) * pow2_scale(ks)[None, :]
        sc = 1.0
    if MASKED:
        s = tl.where((j < end)[None, :], s, float("-inf"))
    if V_FMT == 0:
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, DOT_DTYPE, False)
    else:
        v = _codes(V0, row[:, None], d[None, :], d_ok, D, BLOCK_D, V_FMT, CODE_DTYPE, DIRECT)
    return _weigh(s, sc, acc, m_i, l_i, v, ve, V_FMT != 0, DOT_PREC)


@triton.jit
def _raw(
    qd,
    qk_scale,
    acc,
    m_i,
    l_i,
    KP,
    VP,
    row,
    ok,
    seen,
    d,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
    MASKED: tl.constexpr,
    DOT_PREC: tl.constexpr,
):
    """One tile of raw keys and values at rows ``row`` (``[N]`` int64) of ``KP``/``VP``. ``MASKED``:
    ``ok`` the keys to read and ``seen`` (``[BLOCK_M, N]``) the keys each query row sees (padding,
    causality); else every key is read and seen by every row."""
    at = row[:, None] * D + d[None, :]
    if MASKED:
        kv_ok = ok[:, None] & (d < D)[None, :]
        k = tl.load(KP + at, mask=kv_ok, other=0.0)
        v = tl.load(VP + at, mask=kv_ok, other=0.0)
    elif BLOCK_D == D:
        k = tl.load(KP + at)
        v = tl.load(VP + at)
    else:
        k = tl.load(KP + at, mask=(d < D)[None, :], other=0.0)
        v = tl.load(VP + at, mask=(d < D)[None, :], other=0.0)
    s = tl.dot(qd, tl.trans(k.to(qd.dtype)), input_precision=DOT_PREC)
    if MASKED:
        s = tl.where(seen, s, float("-inf"))
    return _weigh(s, qk_scale, acc, m_i, l_i, v.to(qd.dtype), row, False, DOT_PREC)


@jit_unspecialized(ints=(*STEP_INTS, "T"), pointers=STEP_POINTERS)  # as `attend._extend_kernel`'s
def _flash_extend_kernel(
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
    T,
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
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PREFETCH: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
    LATE_FIRST: tl.constexpr,
):
    m_blocks = tl.cdiv(T * GROUP, BLOCK_M)
    b = tl.program_id(0) // m_blocks
    mb = tl.program_id(0) % m_blocks
    if LATE_FIRST:
        mb = m_blocks - 1 - mb
    h = tl.program_id(1)
    split = tl.program_id(2)

    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // GROUP
    row_ok = t < T
    q_row = (b * T + t).to(tl.int64) * (H * GROUP) + h * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    # q as the dot operand of raw keys (the softmax scale, base 2, applied in `_weigh`).
    q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=row_ok[:, None] & (d < D)[None, :], other=0.0)
    qd = q.to(DOT_DTYPE)
    qc = (q.to(tl.float32) * qk_scale).to(CODE_DTYPE)  # FP8 key codes: the scale folded into q

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Cold pages: whole tiles of BLOCK_N keys across pages unmasked, then the partial last tile.
    n = tl.arange(0, BLOCK_N)
    lo = split * pages_per_split * P
    end = tl.minimum(split * pages_per_split + pages_per_split, tl.load(COLD_LEN + b)) * P
    full = lo + tl.maximum(end - lo, 0) // BLOCK_N * BLOCK_N
    pt = PT + b * pt_stride
    if PREFETCH:
        # Page-table entries and FP8 scale bytes a tile ahead: a tile's copies do not wait on its
        # table load, nor its softmax on scale loads issued in the same tile.
        page = tl.load(pt + (lo + n) // P, mask=lo + n < end, other=0).to(tl.int64)
        ks, ve = _scales(K1, V1, page, lo + n, h, H, P, K_FMT, V_FMT)
    for j0 in range(lo, full, BLOCK_N):
        if PREFETCH:
            ahead = j0 + BLOCK_N + n
            page_ahead = tl.load(pt + ahead // P, mask=ahead < end, other=0).to(tl.int64)
            ks_ahead, ve_ahead = _scales(K1, V1, page_ahead, ahead, h, H, P, K_FMT, V_FMT)
        else:
            page = tl.load(pt + (j0 + n) // P).to(tl.int64)
            ks, ve = _scales(K1, V1, page, j0 + n, h, H, P, K_FMT, V_FMT)
        acc, m_i, l_i = _cold(
            qd, qc, qk_scale, acc, m_i, l_i, page, ks, ve, K0, V0, j0 + n, end, d, h, H,
            P, D, BLOCK_D, K_FMT, V_FMT, False, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W,
        )  # fmt: skip
        if PREFETCH:
            page, ks, ve = page_ahead, ks_ahead, ve_ahead
    if full < end:
        page = tl.load(pt + (full + n) // P, mask=full + n < end, other=0).to(tl.int64)
        ks, ve = _scales(K1, V1, page, full + n, h, H, P, K_FMT, V_FMT)
        acc, m_i, l_i = _cold(
            qd, qc, qk_scale, acc, m_i, l_i, page, ks, ve, K0, V0, full + n, end, d, h, H,
            P, D, BLOCK_D, K_FMT, V_FMT, True, DOT_PREC, DOT_DTYPE, CODE_DTYPE, NORM_W,
        )  # fmt: skip

    if split == tail_split:  # sinks, ring and new tokens: the last split of the text pool's pass
        if HAS_SINKS:
            sink_len = tl.load(SINK_OK + b) * P  # P keys when the sequence has a sink page, else 0
            slot = tl.load(ST + b).to(tl.int64)
            for j0 in range(0, sink_len, BLOCK_N):
                ok = j0 + n < sink_len
                acc, m_i, l_i = _raw(
                    qd, qk_scale, acc, m_i, l_i, SK, SV, (slot * P + j0 + n) * H + h, ok, ok[None, :], d,
                    D, BLOCK_D, True, DOT_PREC,
                )  # fmt: skip
        ring_len = tl.load(RING_LEN + b)
        for j0 in range(0, ring_len, BLOCK_N):
            ok = j0 + n < ring_len
            ring_row = tl.load(RR + b * rr_stride + j0 + n, mask=ok, other=0).to(tl.int64)
            acc, m_i, l_i = _raw(
                qd, qk_scale, acc, m_i, l_i, RK, RV, ring_row * H + h, ok, ok[None, :], d,
                D, BLOCK_D, True, DOT_PREC,
            )  # fmt: skip
        # New tokens, causal: keys before the block's first token are seen by all its rows (whole
        # tiles of them unmasked); the tiles from there to the block's last token are masked.
        first = mb * BLOCK_M // GROUP
        seen_all = first // BLOCK_N * BLOCK_N
        for j0 in range(0, seen_all, BLOCK_N):
            new_row = (b * T + j0 + n).to(tl.int64) * H + h
            acc, m_i, l_i = _raw(
                qd, qk_scale, acc, m_i, l_i, KN, VN, new_row, None, None, d, D, BLOCK_D, False, DOT_PREC
            )
        last = tl.minimum(T, (mb * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        for j0 in range(seen_all, last, BLOCK_N):
            j = j0 + n
            ok = j < T
            seen = ok[None, :] & (j[None, :] <= t[:, None])
            new_row = (b * T + j).to(tl.int64) * H + h
            acc, m_i, l_i = _raw(
                qd, qk_scale, acc, m_i, l_i, KN, VN, new_row, ok, seen, d, D, BLOCK_D, True, DOT_PREC
            )

    o_at, inv = _out_rows(m_i, l_i, q_row, row_ok, split, num_splits, OUT, PO, PL, D, SPLIT)
    out_ok = row_ok[:, None] & (d < D)[None, :]
    tl.store(o_at + d[None, :], (acc * inv[:, None]).to(o_at.dtype.element_ty), mask=out_ok)
