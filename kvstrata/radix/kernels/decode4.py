"""Decode attention over 4-bit strata (int4 and fp4_e2m1 keys and values): whole bytes, FP16 operands.

The 4-bit twin of `kvstrata.radix.kernels.decode`, driven by the same plan, split-KV rule and launch
table entry (``DECODE_LAUNCH[True]`` with ``module`` "decode4"): one program per (sequence, KV head,
split). Cold tiles are ``BLOCKS`` 16-token blocks, each inside one page, read as whole bytes
``[BLOCKS, 16, D/2]``: the low nibbles are the even channels and the high ones the odd channels, so
q is split once per program into its even and odd channels (scores = two K = D/2 products) and the
output accumulates in even and odd halves, put back in order only by the final store. Codes become
FP16 dot operands (`nibble_pairs`; ``ASM``: packed PTX, eight codes an instance, no float32 round
trip).

Keys, ``FOLD`` (the default, ``fold_key_scales``): a key's per-channel scales (int4: scale and zero
point per page-head; fp4: E4M3 per 16-token block) are the same for the 16 keys of a block, so they
are folded into the query once per block instead of applied to every key byte: ``q . (s * code +
o) = (q * s) . code + q . o``. The tile's rows are ``BLOCKS`` slots of ``SLOT_R`` rows (the GQA
group padded, at least 16 rows in all); slot b holds the query times block b's scales
(`_folded_query`) and sees only block b's keys, so one product of the whole tile scores every block
against its own scaled query (the other blocks' scores are masked), the codes going in raw (int4
0..15, fp4 E2M1 times 2**-14, exact in FP16). Each slot keeps its own softmax state over the blocks
it sees; the slots merge once, after the last tile. q is divided by a power of two per program so
that q times a scale stays within FP16 (int4 scale codes < 32, fp4 block scales <= 448). Without
``FOLD`` (pass 5): one slot, the GQA group padded to ``BLOCK_H`` rows, int4 keys decoded as ``code *
s + o`` in FP16 per byte (`key_block_scales`), fp4 keys as E2M1 times the block scale, the page's
global scale on the score columns.

Values: the codes alone (int4) or times their 32-channel block scale (fp4, exact); the per-token
scale (int4 ``s``, fp4 global times 2**14) folds into the softmax weights, divided by the tile's
largest so the FP16 weights stay normal, and int4's per-token offset adds ``sum(p * o)``.

FP16 rather than BF16 operands: 11-bit significands (E2M1 and E4M3 products are exact in it), at the
cost of range (hence the power of two on q; a product under 2**-14 is an FP16 subnormal, off by under
2**-25 of q's largest element). A float32 model (and the interpreter) keeps float32 operands
(``CODE_DTYPE``). The sink page, ring rows and the new key (BF16/float32) are read by
`_tail_tile` in the same channel halves (with ``TAIL_T``, `_tail_tile_t`: turned over, whole rows),
in tiles of ``TAIL_N`` keys, by slot 0's rows; the
cold blocks a split has past its last whole tile one block at a time (slot 0; a split's cold keys
are whole pages of whole blocks: no tile is ever masked). ``PREFETCH`` loads the page-table entries
and the scales Triton's pipeliner leaves in the loop (`_side_scales`) a tile ahead. Measured on the
H200: docs/kernels-h200.md, passes 5 and 7.

Launch options of pass 9 (docs/kernels-h200.md, "Pass 9, 4-bit"), with ``FOLD``: ``KEYS_AS_ROWS``
turns the products over (scores ``k . q^T``, the output ``v^T . p``), so that the query side is the
product's N (8 columns for the 8B's group of 4 at 2 blocks, against M's 16 rows, half of them padding,
without it): half the tensor-core products, score and accumulator elements a tile. ``VALUE_REF``
keeps the accumulator in units of a running value scale (`_cold_tile4`). Pass 12 (docs/kernels-h200.md):
``VALUE_QUADS`` reads the value codes as 16-bit elements (`nibble_quads`), so that P.V's operand, which
pairs one channel of two keys, loads by a transposing ldmatrix instead of byte by byte.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvstrata.quant.kernel_decode import (
    INT4_KEY_F16_UNIT,
    INT4_MAGIC_HI,
    INT4_MAGIC_LO,
    bf16_bits_value,
    fp4_key_block_pairs,
    fp4_key_block_scales,
    fp8_value,
    int4_key_scale_codes,
    int4_key_words,
    int4_value_scale,
    key_block_scales,
    nibble_pairs,
    nibble_quads,
    value_tile_scales,
)
from kvstrata.radix.kernels.attend import (
    DECODE_POINTERS,
    HALF_FORMATS,
    INT4_FORMAT,
    STEP_INTS,
    _accumulate,
    _online,
    _raw_tile,
    _scores,
    _turned_tile,
    decode_program,
    merge_if_last,
)
from kvstrata.radix.kernels.jit import jit_unspecialized

# Keys a tile of the sink page, ring rows and the new key (BF16 channel halves loaded element by
# element; a few tiles in one split a step), unless a launch sets ``tail_n``.
TAIL_N = 32
# ``VALUE_REF``: the reference scale of a tile is at least the largest value scale seen times this, so
# that the accumulator (in units of it) stays within float32 (sums of at most 2**20 weights of 1 times
# codes under 2**4: under 2**114).
VALUE_REF_FLOOR = tl.constexpr(2.0**-90)


def applies(k_fmt: int, v_fmt: int, head_dim: int, page_size: int) -> bool:
    """Whether `_decode4_kernel` reads this layer: 4-bit keys and values, a power-of-two head_dim of
    32 or more (fp4 value blocks of 32 channels, 16-wide halves for `tl.dot`), 16-token blocks."""
    pow2 = head_dim & (head_dim - 1) == 0
    return k_fmt in HALF_FORMATS and v_fmt in HALF_FORMATS and pow2 and head_dim >= 32 and page_size % 16 == 0


@triton.jit
def _tail_tile(
    q0, q1, acc0, acc1, m_i, l_i, KP, VP, row, ok, seen,
    D: tl.constexpr, DOT_PREC: tl.constexpr, ROWS: tl.constexpr,
):  # fmt: skip
    """One tile of the decode tail (sink page, ring rows, new key: raw model-dtype rows ``row`` of
    ``KP``/``VP``, ``ok`` the keys to read, ``seen`` the query rows that see them) in the kernel's
    even and odd channel halves. ``ROWS``: each key's and value's D channels load as one contiguous
    row (16-byte vectors) and split into the halves in registers; else `attend._raw_tile`'s two
    strided loads of 2-byte elements per row (Triton 3.6, sm_90: 257 global loads a 32-key tile)."""
    if ROWS:
        n: tl.constexpr = row.shape[0]
        at = row[:, None] * D + tl.arange(0, D)[None, :]
        kx = tl.load(KP + at, mask=ok[:, None], other=0.0).to(q0.dtype)
        vx = tl.load(VP + at, mask=ok[:, None], other=0.0).to(q0.dtype)
        k0, k1 = tl.split(tl.reshape(kx, [n, D // 2, 2]))
        v0, v1 = tl.split(tl.reshape(vx, [n, D // 2, 2]))
        s = tl.where(seen, _scores(q0, q1, k0, k1, True, DOT_PREC), float("-inf"))
        p, alpha, m_i, l_i = _online(s, m_i, l_i)
        acc0, acc1 = _accumulate(acc0, acc1, alpha, p, v0, v1, True, DOT_PREC)
    else:
        c0 = 2 * tl.arange(0, D // 2)
        acc0, acc1, m_i, l_i = _raw_tile(
            q0, q1, acc0, acc1, m_i, l_i, KP, VP, row, ok, seen, c0, c0 + 1, c0, c0 + 1, D, True, True,
            DOT_PREC,
        )  # fmt: skip
    return acc0, acc1, m_i, l_i


@triton.jit
def _tail_tile_t(qt, acc, m_i, l_i, KP, VP, row, ok, seen, D: tl.constexpr, DOT_PREC: tl.constexpr):
    """`_tail_tile` turned over, as the cold tiles with ``KEYS_AS_ROWS``: scores ``k . q^T`` ``[n,
    rows]`` (``qt`` the whole query transposed, ``[D, rows]``; ``seen`` ``[n, rows]``) and the output
    ``acc`` ``[D, rows]`` += ``v^T . p``. The keys are the products' M side and the query rows their
    N (8 rows with ``keys_as_rows``' 8-row slots, not 16 padded ones), and each key and value row
    loads whole into both products (ldmatrix, transposing for the values) with no split into channel
    halves."""
    d = tl.arange(0, D)
    k = tl.load(KP + row[:, None] * D + d[None, :], mask=ok[:, None], other=0.0).to(qt.dtype)
    vt = tl.load(VP + row[None, :] * D + d[:, None], mask=ok[None, :], other=0.0).to(qt.dtype)
    return _turned_tile(k, vt, qt, seen, acc, m_i, l_i, DOT_PREC)


@triton.jit
def _tail_keys(
    qd0, qd1, acc0, acc1, m_i, l_i, KP, VP, row, ok, first,
    D: tl.constexpr, DOT_PREC: tl.constexpr, ROWS: tl.constexpr, TURNED: tl.constexpr,
):  # fmt: skip
    """One tile of the decode tail, seen by the query rows ``first`` (slot 0's): `_tail_tile` over the
    channel halves, or with ``TURNED`` `_tail_tile_t` (``qd0`` the whole query ``[D, rows]``, ``acc0``
    the whole output ``[D, rows]``; ``qd1`` and ``acc1`` unused, returned as given; ``ROWS`` unused:
    its rows always load whole)."""
    if TURNED:
        acc0, m_i, l_i = _tail_tile_t(
            qd0, acc0, m_i, l_i, KP, VP, row, ok, ok[:, None] & first[None, :], D, DOT_PREC
        )  # fmt: skip
    else:
        acc0, acc1, m_i, l_i = _tail_tile(
            qd0, qd1, acc0, acc1, m_i, l_i, KP, VP, row, ok, ok[None, :] & first[:, None], D, DOT_PREC, ROWS
        )  # fmt: skip
    return acc0, acc1, m_i, l_i


@triton.jit
def _rows(j0, pb, pv, h, H, P: tl.constexpr, BLOCKS: tl.constexpr):
    """Rows of a tile's keys in the parts: ``[BLOCKS, 1, 1]`` pages and first tokens of its blocks
    (keys' per-channel scales), and ``[16 * BLOCKS]`` (page, token, head) rows of its keys."""
    jb = j0 + tl.arange(0, BLOCKS) * 16  # first key of each block
    j = j0 + tl.arange(0, BLOCKS * 16)
    rv = (pv.to(tl.int64) * P + j % P) * H + h
    return pb.to(tl.int64)[:, None, None], (jb % P).to(tl.int64)[:, None, None], rv


@triton.jit
def _entries(pt, j0, end, jb, jn, jr, P: tl.constexpr):
    """Page-table entries of the tile from key ``j0``: `_rows`' ``pb``/``pv`` and each query row's page
    ``pr`` (``jb``/``jn``/``jr``: the offsets of the blocks' first keys, of the keys and of the rows'
    blocks' first keys), page 0 past ``end``, the split's end (a tile past the last is loaded ahead
    and never read)."""
    pb = tl.load(pt + (j0 + jb) // P, mask=j0 + jb < end, other=0)
    pv = tl.load(pt + (j0 + jn) // P, mask=j0 + jn < end, other=0)
    pr = tl.load(pt + (j0 + jr) // P, mask=j0 + jr < end, other=0)
    return pb, pv, pr


@triton.jit
def _key_unit(K1, K2, pr, h, H, D: tl.constexpr, K_FMT: tl.constexpr):
    """A ``FOLD`` tile's page-head key word of each query row's page ``pr``, as stored: int4 the unit's
    BF16 bits (after the page-head's channel words), fp4 the page's global scale."""
    if K_FMT == 5:  # noqa: SIM108  (constexpr branches of a Triton function)
        word = tl.load(K1 + int4_key_words(pr, h, H, D) + D)
    else:
        word = tl.load(K2 + pr * H + h)
    return word


@triton.jit
def _value_word(V1, V2, rv, V_FMT: tl.constexpr):
    """The per-token value word of the tile's keys ``rv``, as stored: fp4 the global scale, int4 the
    scale and offset word."""
    if V_FMT == 6:  # noqa: SIM108  (constexpr branches of a Triton function)
        word = tl.load(V2 + rv)
    else:
        word = tl.load(V1 + rv)
    return word


@triton.jit
def _words(
    K1, K2, V1, V2, j0, pb, pv, pr, h, H,
    P: tl.constexpr, D: tl.constexpr, BLOCKS: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
):  # fmt: skip
    """The small scale words of the tile from key ``j0`` (`_key_unit`'s, `_value_word`'s), which
    ``TABLE_AHEAD`` loads a tile ahead with the page-table entries ``pb``/``pv``/``pr``: a register or
    two a thread (carrying the larger block-scale tensors instead made Triton move the decoded codes
    through shared memory)."""
    rv = _rows(j0, pb, pv, h, H, P, BLOCKS)[2]
    return _key_unit(K1, K2, pr, h, H, D, K_FMT), _value_word(V1, V2, rv, V_FMT)


@triton.jit
def _folded_query(
    qf0, qf1, q_mul, K1, K2, pb, tb, pr, h, H,
    P: tl.constexpr, D: tl.constexpr, BLOCKS: tl.constexpr, K_FMT: tl.constexpr, CODE_DTYPE: tl.constexpr,
    WIDE_SCALES: tl.constexpr, ku, KU_GIVEN: tl.constexpr,
):  # fmt: skip
    """The query halves with the per-channel key scales of each row's block folded in, ``(qs0, qs1,
    bias, mult)``: the row's scores are ``(qs . codes + bias) * mult`` over its block's raw codes.
    Rows go by blocks (``[BLOCKS, rows / BLOCKS]``): ``pb``/``tb`` (``[BLOCKS, 1, 1]``) the page and
    first token of each block, ``pr`` (``[rows]``) each row's page; ``qf0``/``qf1`` the float32 query
    halves divided by ``q_mul`` (a power of two). int4: ``qs = q * s`` and ``bias = q . z`` with the
    channels' scale codes ``s`` (`int4_key_scale_codes`) and zero points ``z`` in units of the
    page-head's unit, which joins ``mult``. fp4: ``qs = q * b`` with the block's E4M3 scales, no
    bias, the page's global scale (times 2**14: the codes are E2M1 times 2**-14) in ``mult``; with
    ``WIDE_SCALES`` the block scales read as channel pairs (`fp4_key_block_pairs`). ``KU_GIVEN``: the
    page-head words (`_key_unit`) are ``ku``, loaded a tile ahead; else they load here, inline (through
    `_key_unit` the compiled default's epilogue took other registers)."""
    HD: tl.constexpr = D // 2
    ROWS: tl.constexpr = qf0.shape[0]
    ck = tl.arange(0, HD)[None, None, :]
    a0 = tl.reshape(qf0, [BLOCKS, ROWS // BLOCKS, HD])
    a1 = tl.reshape(qf1, [BLOCKS, ROWS // BLOCKS, HD])
    if K_FMT == 5:  # a word per channel, the page-head unit after them
        w0 = int4_key_words(pb, h, H, D)
        s0, z0 = int4_key_scale_codes(tl.load(K1 + w0 + 2 * ck).to(tl.int32))
        s1, z1 = int4_key_scale_codes(tl.load(K1 + w0 + 2 * ck + 1).to(tl.int32))
        bias = tl.reshape(tl.sum(a0 * z0 + a1 * z1, 2), [ROWS]) * (1.0 / INT4_KEY_F16_UNIT)
        if KU_GIVEN:  # noqa: SIM108  (constexpr branches of a Triton function)
            unit = bf16_bits_value(ku)
        else:
            unit = bf16_bits_value(tl.load(K1 + int4_key_words(pr, h, H, D) + D))
        mult = unit * (q_mul * INT4_KEY_F16_UNIT)
    else:
        if WIDE_SCALES:
            s0, s1 = fp4_key_block_pairs(K1, pb, tb, h, ck, H, P, D)
        else:
            s0, s1 = fp4_key_block_scales(K1, pb, tb, h, 2 * ck, 2 * ck + 1, ck < HD, H, P, D)
        bias = 0.0
        if KU_GIVEN:  # noqa: SIM108  (constexpr branches of a Triton function)
            mult = ku.to(tl.float32) * (16384.0 * q_mul)
        else:
            mult = tl.load(K2 + pr * H + h).to(tl.float32) * (16384.0 * q_mul)
    qs0 = tl.reshape(a0 * s0, [ROWS, HD]).to(CODE_DTYPE)
    return qs0, tl.reshape(a1 * s1, [ROWS, HD]).to(CODE_DTYPE), bias, mult


@triton.jit
def _side_scales(
    K1, K2, V1, V2, j0, pb, pv, pr, qf0, qf1, q_mul, h, H,
    P: tl.constexpr, D: tl.constexpr, BLOCKS: tl.constexpr, K_FMT: tl.constexpr, V_FMT: tl.constexpr,
    FOLD: tl.constexpr, CODE_DTYPE: tl.constexpr, WIDE_SCALES: tl.constexpr,
    ku, vw, WORDS_GIVEN: tl.constexpr,
):  # fmt: skip
    """The scales of a tile that Triton's pipeliner does not copy ahead (narrower than 32 bits, or
    not feeding a dot), loaded here so that the kernel can load them a tile ahead (``PREFETCH``):
    four key terms, then two value terms. Keys: with ``FOLD`` `_folded_query`'s four; else fp4 keys'
    block scales ``(b0, b1)`` ``[BLOCKS, 1, D/2]`` and global scales times 2**14 ``[16 * BLOCKS]``
    (int4 keys: zeros, their scales are the pipeliner's). Values: fp4 block scales ``[16 * BLOCKS,
    D/32, 1]`` and global scales times 2**14, or int4 values' scales and offsets. ``WIDE_SCALES``
    (``FOLD``, fp4 keys): the key block scales read 16 bits at a time, so that Triton's pipeliner
    copies them ahead with the codes (`fp4_key_block_pairs`). ``WORDS_GIVEN`` (``FOLD``): the tile's
    page-head key words and per-token value words (`_key_unit`, `_value_word`) are ``ku`` and ``vw``,
    loaded a tile ahead (``TABLE_AHEAD``); else they load here."""
    pb3, tb3, rv = _rows(j0, pb, pv, h, H, P, BLOCKS)
    ck = tl.arange(0, D // 2)[None, None, :]
    if FOLD:
        ka, kb, kc, kd = _folded_query(
            qf0, qf1, q_mul, K1, K2, pb3, tb3, pr, h, H, P, D, BLOCKS, K_FMT, CODE_DTYPE, WIDE_SCALES,
            ku, WORDS_GIVEN,
        )  # fmt: skip
    elif K_FMT == 6:
        ka, kb = fp4_key_block_scales(K1, pb3, tb3, h, 2 * ck, 2 * ck + 1, ck < D // 2, H, P, D)
        kc = tl.load(K2 + pv.to(tl.int64) * H + h).to(tl.float32) * 16384.0
        kd = 0.0
    else:
        ka, kb, kc, kd = 0.0, 0.0, 0.0, 0.0
    if V_FMT == 6:
        g = tl.arange(0, D // 32)[None, :, None]
        vx = fp8_value(tl.load(V1 + rv[:, None, None] * (D // 32) + g), False)
        if WORDS_GIVEN:  # noqa: SIM108  (constexpr branches of a Triton function)
            vy = vw.to(tl.float32) * 16384.0
        else:
            vy = value_tile_scales(V1, V2, rv, 6)[0] * 16384.0
    elif WORDS_GIVEN:
        vx, vy = int4_value_scale(vw.to(tl.int32))
    else:
        vx, vy = value_tile_scales(V1, V2, rv, 5)
    return ka, kb, kc, kd, vx, vy


@triton.jit
def _cold_tile4(
    qc0,
    qc1,
    acc0,
    acc1,
    acc2,
    acc3,
    m_i,
    l_i,
    o_i,
    v_ref,
    v_hi,
    K0,
    K1,
    K2,
    V0,
    j0,
    pb,
    pv,
    side,
    slot,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCKS: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    ASM: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    DOT_PREC: tl.constexpr,
    FOLD: tl.constexpr,
    OFFSETS_APART: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,
    VALUE_REF: tl.constexpr,
    VALUE_QUADS: tl.constexpr,
    MAGIC: tl.constexpr,
):
    """Keys ``j0`` to ``j0 + 16 * BLOCKS`` of the sequence's cold pages, in pages ``pb`` (``[BLOCKS]``,
    each block's) and ``pv`` (``[16 * BLOCKS]``, each key's), with the tile's `_side_scales`
    ``side``. All of them keys: no masks (a split's cold keys are whole pages of whole blocks).
    ``FOLD``: query row ``i`` sees only the keys of block ``slot[i]``, scored with `_folded_query`'s
    terms in ``side`` (``qc0``/``qc1`` unused); else every row sees every key. int4 values'
    offsets ``sum(p * o)`` (one number a row) add to every channel of the accumulator, or with
    ``OFFSETS_APART`` to ``o_i``, a row's running sum of them (rescaled as ``l_i``), which the
    kernel adds to the accumulator once, after the cold tiles. ``KEYS_AS_ROWS``: the products turned
    over, scores ``k . q^T`` ``[keys, rows]`` (softmax along axis 0) and the output ``v^T . p`` in
    ``[D/2, rows]`` halves (``acc0``/``acc1``). ``VALUE_REF``: the accumulator is kept in units of
    ``v_ref``, the tile's largest value scale (at least ``VALUE_REF_FLOOR`` times ``v_hi``, the
    largest seen), so that the product adds to the accumulator carried into the new units
    (``acc * alpha * old / new``) with no multiply of the product by the tile's scale.
    ``VALUE_QUADS`` (with ``KEYS_AS_ROWS``): the value codes read as 16-bit elements (`nibble_quads`),
    the output in four ``[D/4, rows]`` parts ``acc0`` to ``acc3`` (part i: channels 4j + i), else in
    the even/odd halves ``acc0``/``acc1`` (``acc2``/``acc3`` unused). ``MAGIC`` (int4 keys and values,
    with ``FOLD``, ``KEYS_AS_ROWS``, ``VALUE_QUADS`` and ``VALUE_REF``): the codes come with their FP16
    offsets (`nibble_pairs`, `nibble_quads`); the scores' product starts from minus the offsets times
    the folded query (a product with a constant operand, in the same tensor-core accumulation), and
    each accumulator part from its carried value minus its offset times the column sums of the
    tile's FP16 weights."""
    HD: tl.constexpr = D // 2
    N: tl.constexpr = BLOCKS * 16
    tl.static_assert(
        not MAGIC or (K_FMT == 5 and V_FMT == 5 and FOLD and KEYS_AS_ROWS and VALUE_QUADS and VALUE_REF),
        "MAGIC: int4 keys and values, folded, keys as rows, value quads and the value reference",
    )
    ka, kb, kc, kd, vx, vy = side
    pb, tb, rv = _rows(j0, pb, pv, h, H, P, BLOCKS)
    c = tl.arange(0, HD)
    ck = c[None, None, :]
    kbytes = tl.load(K0 + ((pb * P + tb + tl.arange(0, 16)[None, :, None]) * H + h) * HD + ck)
    if FOLD:
        k0, k1 = nibble_pairs(kbytes, 1.0, 0.0, 1.0, 0.0, K_FMT, False, ASM, CODE_DTYPE, MAGIC)
        qc0 = ka
        qc1 = kb
    elif K_FMT == 6:
        k0, k1 = nibble_pairs(kbytes, ka, ka, kb, kb, 6, True, ASM, CODE_DTYPE)
    else:
        s0, s1, o0, o1 = key_block_scales(K1, K2, pb, tb, h, 2 * ck, 2 * ck + 1, ck < HD, H, P, D, K_FMT)
        k0, k1 = nibble_pairs(kbytes, s0, o0, s1, o1, 5, True, ASM, CODE_DTYPE)
    k0 = tl.reshape(k0, [N, HD])
    k1 = tl.reshape(k1, [N, HD])
    if KEYS_AS_ROWS:  # scores k . q^T [N, rows], the softmax along the keys (axis 0)
        if MAGIC:  # minus the codes' offsets times the query, then the offset codes' products
            s = tl.dot(tl.full([N, HD], -INT4_MAGIC_LO, CODE_DTYPE), tl.trans(qc0), input_precision=DOT_PREC)
            s = tl.dot(
                tl.full([N, HD], -INT4_MAGIC_HI, CODE_DTYPE), tl.trans(qc1), s, input_precision=DOT_PREC
            )
            s = tl.dot(k0, tl.trans(qc0), s, input_precision=DOT_PREC)
        else:
            s = tl.dot(k0, tl.trans(qc0), input_precision=DOT_PREC)
        s += tl.dot(k1, tl.trans(qc1), input_precision=DOT_PREC)
        if K_FMT == 5:
            s += kc[None, :]
        s = tl.where((tl.arange(0, N) // 16)[:, None] == slot[None, :], s * kd[None, :], float("-inf"))
        p, alpha, m_i, l_i = _online(s, m_i, l_i, 0)
    else:
        s = tl.dot(qc0, tl.trans(k0), input_precision=DOT_PREC)
        s += tl.dot(qc1, tl.trans(k1), input_precision=DOT_PREC)
        if FOLD:
            if K_FMT == 5:
                s += kc[:, None]
            s = tl.where(slot[:, None] == (tl.arange(0, N) // 16)[None, :], s * kd[:, None], float("-inf"))
        elif K_FMT == 6:  # the page's global scale (times 2**14) on each key's column
            s = s * kc[None, :]
        p, alpha, m_i, l_i = _online(s, m_i, l_i)

    if VALUE_QUADS:  # [N, D/4] 16-bit elements (fp4: [N, 32-channel blocks, 8]), four code positions
        v16 = V0.to(tl.pointer_type(tl.uint16))
        if V_FMT == 6:
            g = tl.arange(0, D // 32)[None, :, None]
            vh = tl.load(v16 + rv[:, None, None] * (D // 4) + g * 8 + tl.arange(0, 8)[None, None, :])
            u0, u1, u2, u3 = nibble_quads(vh, vx, 6, ASM, CODE_DTYPE)
            vs = vy
        else:
            vh = tl.load(v16 + rv[:, None] * (D // 4) + tl.arange(0, D // 4)[None, :])
            u0, u1, u2, u3 = nibble_quads(vh, 1.0, 5, ASM, CODE_DTYPE, MAGIC)
            vs = vx
        v0 = tl.reshape(u0, [N, D // 4])
        v1 = tl.reshape(u1, [N, D // 4])
        v2 = tl.reshape(u2, [N, D // 4])
        v3 = tl.reshape(u3, [N, D // 4])
    elif V_FMT == 6:  # [N, 32-channel blocks, 16 bytes]: a block's scale loads once per row
        g = tl.arange(0, HD // 16)[None, :, None]
        vb = tl.load(V0 + rv[:, None, None] * HD + g * 16 + tl.arange(0, 16)[None, None, :])
        v0, v1 = nibble_pairs(vb, vx, vx, vx, vx, 6, True, ASM, CODE_DTYPE)
        v0 = tl.reshape(v0, [N, HD])
        v1 = tl.reshape(v1, [N, HD])
        vs = vy
    else:
        vb = tl.load(V0 + rv[:, None] * HD + c[None, :])
        v0, v1 = nibble_pairs(vb, 1.0, 0.0, 1.0, 0.0, 5, False, ASM, CODE_DTYPE)
        vs = vx
    if VALUE_REF:  # the weights over the new reference, the accumulator carried to it in the product
        v_hi = tl.maximum(v_hi, tl.max(vs, 0))
        top = tl.maximum(tl.maximum(tl.max(vs, 0), v_hi * VALUE_REF_FLOOR), 1.1754943508222875e-38)
        carry = alpha * (v_ref / top)
        v_ref = top
    else:
        top = tl.max(vs, 0) + 1.1754943508222875e-38
        carry = alpha
    if KEYS_AS_ROWS:  # the output transposed, [D/2, rows] halves (or [D/4, rows] parts): v^T . p
        w = (p * (vs * (1.0 / top))[:, None]).to(CODE_DTYPE)
        v0 = tl.trans(v0)
        v1 = tl.trans(v1)
        if VALUE_QUADS:
            v2 = tl.trans(v2)
            v3 = tl.trans(v3)
        carry = carry[None, :]
    else:
        w = (p * (vs * (1.0 / top))[None, :]).to(CODE_DTYPE)
        carry = carry[:, None]
    if MAGIC:  # parts 0 and 2 hold the low offset, 1 and 3 the high one, times the weights' column sums
        w_sum = tl.sum(w.to(tl.float32), 0)[None, :]
        acc0 = tl.dot(v0, w, acc0 * carry - w_sum * INT4_MAGIC_LO, input_precision=DOT_PREC)
        acc1 = tl.dot(v1, w, acc1 * carry - w_sum * INT4_MAGIC_HI, input_precision=DOT_PREC)
        acc2 = tl.dot(v2, w, acc2 * carry - w_sum * INT4_MAGIC_LO, input_precision=DOT_PREC)
        acc3 = tl.dot(v3, w, acc3 * carry - w_sum * INT4_MAGIC_HI, input_precision=DOT_PREC)
    elif VALUE_REF and KEYS_AS_ROWS:  # (VALUE_QUADS comes with KEYS_AS_ROWS)
        acc0 = tl.dot(v0, w, acc0 * carry, input_precision=DOT_PREC)
        acc1 = tl.dot(v1, w, acc1 * carry, input_precision=DOT_PREC)
        if VALUE_QUADS:
            acc2 = tl.dot(v2, w, acc2 * carry, input_precision=DOT_PREC)
            acc3 = tl.dot(v3, w, acc3 * carry, input_precision=DOT_PREC)
    elif VALUE_REF:
        acc0 = tl.dot(w, v0, acc0 * carry, input_precision=DOT_PREC)
        acc1 = tl.dot(w, v1, acc1 * carry, input_precision=DOT_PREC)
    elif KEYS_AS_ROWS:
        acc0 = acc0 * carry + tl.dot(v0, w, input_precision=DOT_PREC) * top
        acc1 = acc1 * carry + tl.dot(v1, w, input_precision=DOT_PREC) * top
        if VALUE_QUADS:
            acc2 = acc2 * carry + tl.dot(v2, w, input_precision=DOT_PREC) * top
            acc3 = acc3 * carry + tl.dot(v3, w, input_precision=DOT_PREC) * top
    else:
        acc0 = acc0 * carry + tl.dot(w, v0, input_precision=DOT_PREC) * top
        acc1 = acc1 * carry + tl.dot(w, v1, input_precision=DOT_PREC) * top
    if V_FMT == 5:
        if KEYS_AS_ROWS:  # noqa: SIM108  (constexpr branches of a Triton function)
            off = tl.sum(p * vy[:, None], 0)
        else:
            off = tl.sum(p * vy[None, :], 1)
        if VALUE_REF and not OFFSETS_APART:  # the accumulator is in units of the value reference
            off = off * (1.0 / top)
        if OFFSETS_APART:
            o_i = o_i * alpha + off
        elif KEYS_AS_ROWS:
            acc0 += off[None, :]
            acc1 += off[None, :]
            if VALUE_QUADS:
                acc2 += off[None, :]
                acc3 += off[None, :]
        else:
            acc0 += off[:, None]
            acc1 += off[:, None]
    return acc0, acc1, acc2, acc3, m_i, l_i, o_i, v_ref, v_hi


@jit_unspecialized(ints=STEP_INTS, pointers=DECODE_POINTERS)  # as `decode._decode_kernel`'s
def _decode4_kernel(
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
    BLOCKS: tl.constexpr,
    PREFETCH: tl.constexpr,
    TABLE_AHEAD: tl.constexpr,
    WIDE_SCALES: tl.constexpr,
    TAIL_N: tl.constexpr,
    ASM: tl.constexpr,
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
    CODE_DTYPE: tl.constexpr,
    NORM_W: tl.constexpr,
    FOLD: tl.constexpr,
    SLOT_R: tl.constexpr,
    HEADS_TOGETHER: tl.constexpr,
    TAIL_ROWS: tl.constexpr,
    TAIL_T: tl.constexpr,
    OFFSETS_APART: tl.constexpr,
    KEYS_AS_ROWS: tl.constexpr,
    VALUE_REF: tl.constexpr,
    VALUE_QUADS: tl.constexpr,
    COUNT,
    MERGE_S: tl.constexpr,
    MERGE_G: tl.constexpr,
    MAGIC: tl.constexpr = False,
):
    b, h = decode_program(H, HEADS_TOGETHER)
    split = tl.program_id(2)
    # Row i of the tiles is query head h * GROUP + i % SLOT_R; with FOLD it sees only the keys of
    # block ``slot = i // SLOT_R`` of each cold tile (else SLOT_R is BLOCK_H: one slot, all keys).
    i = tl.arange(0, BLOCK_H)
    slot = i // SLOT_R
    r = i % SLOT_R
    row_ok = r < GROUP
    q_row = (b * H + h).to(tl.int64) * GROUP + r  # query head h * GROUP + r of token b
    c0 = 2 * tl.arange(0, D // 2)  # even channels; c0 + 1 the odd ones
    c1 = c0 + 1
    q_at = Q + q_row[:, None] * D
    q0 = tl.load(q_at + c0[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    q1 = tl.load(q_at + c1[None, :], mask=row_ok[:, None], other=0.0).to(tl.float32) * qk_scale
    m_i = tl.full([BLOCK_H], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
    # The cold tiles' output (`_cold_tile4`): with VALUE_QUADS four [D/4, rows] parts, put together
    # into the halves after them; with KEYS_AS_ROWS transposed, turned back after them.
    acc2 = tl.zeros([D // 4, BLOCK_H], dtype=tl.float32)
    acc3 = tl.zeros([D // 4, BLOCK_H], dtype=tl.float32)
    if VALUE_QUADS:
        acc0 = tl.zeros([D // 4, BLOCK_H], dtype=tl.float32)
        acc1 = tl.zeros([D // 4, BLOCK_H], dtype=tl.float32)
    elif KEYS_AS_ROWS:
        acc0 = tl.zeros([D // 2, BLOCK_H], dtype=tl.float32)
        acc1 = tl.zeros([D // 2, BLOCK_H], dtype=tl.float32)
    else:
        acc0 = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
        acc1 = tl.zeros([BLOCK_H, D // 2], dtype=tl.float32)
    o_i = tl.zeros([BLOCK_H], dtype=tl.float32)  # int4 values' offsets with OFFSETS_APART
    v_ref = tl.full([], 1.0, tl.float32)  # with VALUE_REF the cold tiles' output is acc * v_ref
    v_hi = tl.zeros([], dtype=tl.float32)  # the largest per-token value scale seen

    # Cold keys of this split: tiles of BLOCKS blocks, then the blocks left one at a time (a split's
    # keys are whole pages of whole blocks, so no tile is masked and no key is padding).
    n_cold = tl.load(COLD_LEN + b)
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, n_cold)
    end = hi * P
    full = lo * P + tl.maximum(hi - lo, 0) * P // (BLOCKS * 16) * (BLOCKS * 16)
    pt = PT + b * pt_stride
    if FOLD:  # float32 halves over 2**e, |q| <= 2**top: q times a key scale stays under 2**15 in FP16
        # (int4 scale codes < 2**5, read over 2**12 by `int4_key_scale_codes`; fp4 block scales < 2**9)
        q_max = tl.maximum(tl.max(tl.abs(q0)), tl.max(tl.abs(q1)))
        top = 22 if K_FMT == 5 else 6
        e = tl.minimum(tl.maximum(tl.ceil(tl.log2(q_max)) - top, -60.0), 60.0)
        e = e.to(tl.int32)
        q_mul = ((e + 127) << 23).to(tl.float32, bitcast=True)
        qc0 = q0 * ((127 - e) << 23).to(tl.float32, bitcast=True)
        qc1 = q1 * ((127 - e) << 23).to(tl.float32, bitcast=True)
    else:
        q_mul = 1.0
        qc0 = q0.to(CODE_DTYPE)
        qc1 = q1.to(CODE_DTYPE)
    jb = tl.arange(0, BLOCKS) * 16
    jn = tl.arange(0, BLOCKS * 16)
    jr = (slot % BLOCKS) * 16  # first key of each row's block
    tile: tl.constexpr = BLOCKS * 16
    # With TABLE_AHEAD (and FOLD) the tile's small scale words come a tile ahead with its entries.
    WORDS_AHEAD: tl.constexpr = TABLE_AHEAD and FOLD and not PREFETCH
    ku = 0  # the words, unused unless WORDS_AHEAD
    vw = 0
    if PREFETCH or TABLE_AHEAD:  # the first tile's page-table entries, then each next one's in the loop
        pb, pv, pr = _entries(pt, lo * P, end, jb, jn, jr, P)
    if WORDS_AHEAD:
        ku, vw = _words(K1, K2, V1, V2, lo * P, pb, pv, pr, h, H, P, D, BLOCKS, K_FMT, V_FMT)
    if PREFETCH:  # and `_side_scales` a tile ahead: no load waits in the tile
        side = _side_scales(
            K1, K2, V1, V2, lo * P, pb, pv, pr, qc0, qc1, q_mul, h, H,
            P, D, BLOCKS, K_FMT, V_FMT, FOLD, CODE_DTYPE, WIDE_SCALES, 0, 0, False,
        )  # fmt: skip
    for j0 in range(lo * P, full, tile):
        if PREFETCH or TABLE_AHEAD:
            pb_ahead, pv_ahead, pr_ahead = _entries(pt, j0 + tile, end, jb, jn, jr, P)
        if WORDS_AHEAD:
            ku_ahead, vw_ahead = _words(
                K1, K2, V1, V2, j0 + tile, pb_ahead, pv_ahead, pr_ahead, h, H, P, D, BLOCKS, K_FMT, V_FMT
            )  # fmt: skip
        if PREFETCH:
            side_ahead = _side_scales(
                K1, K2, V1, V2, j0 + tile, pb_ahead, pv_ahead, pr_ahead, qc0, qc1, q_mul,
                h, H, P, D, BLOCKS, K_FMT, V_FMT, FOLD, CODE_DTYPE, WIDE_SCALES, 0, 0, False,
            )  # fmt: skip
        else:
            if not TABLE_AHEAD:
                pb = tl.load(pt + (j0 + jb) // P)
                pv = tl.load(pt + (j0 + jn) // P)
                pr = tl.load(pt + (j0 + jr) // P)
            side = _side_scales(
                K1, K2, V1, V2, j0, pb, pv, pr, qc0, qc1, q_mul, h, H,
                P, D, BLOCKS, K_FMT, V_FMT, FOLD, CODE_DTYPE, WIDE_SCALES, ku, vw, WORDS_AHEAD,
            )  # fmt: skip
        acc0, acc1, acc2, acc3, m_i, l_i, o_i, v_ref, v_hi = _cold_tile4(
            qc0, qc1, acc0, acc1, acc2, acc3, m_i, l_i, o_i, v_ref, v_hi, K0, K1, K2, V0, j0, pb, pv, side,
            slot, h, H, P, D, BLOCKS, K_FMT, V_FMT, ASM, CODE_DTYPE, DOT_PREC, FOLD, OFFSETS_APART,
            KEYS_AS_ROWS, VALUE_REF, VALUE_QUADS, MAGIC,
        )  # fmt: skip
        if PREFETCH or TABLE_AHEAD:
            pb = pb_ahead
            pv = pv_ahead
            pr = pr_ahead
        if WORDS_AHEAD:
            ku = ku_ahead
            vw = vw_ahead
        if PREFETCH:
            side = side_ahead
    for j0 in range(full, end, 16):  # one block a tile: slot 0's rows
        pb1 = tl.load(pt + j0 // P + tl.arange(0, 1))
        pv1 = tl.load(pt + (j0 + tl.arange(0, 16)) // P)
        pr1 = tl.load(pt + (j0 + 0 * jr) // P)
        side1 = _side_scales(
            K1, K2, V1, V2, j0, pb1, pv1, pr1, qc0, qc1, q_mul, h, H,
            P, D, 1, K_FMT, V_FMT, FOLD, CODE_DTYPE, WIDE_SCALES, 0, 0, False,
        )  # fmt: skip
        acc0, acc1, acc2, acc3, m_i, l_i, o_i, v_ref, v_hi = _cold_tile4(
            qc0, qc1, acc0, acc1, acc2, acc3, m_i, l_i, o_i, v_ref, v_hi, K0, K1, K2, V0, j0, pb1, pv1, side1,
            slot, h, H, P, D, 1, K_FMT, V_FMT, ASM, CODE_DTYPE, DOT_PREC, FOLD, OFFSETS_APART,
            KEYS_AS_ROWS, VALUE_REF, VALUE_QUADS, MAGIC,
        )  # fmt: skip

    if VALUE_QUADS:  # channels 4j + i in part i: the even halves from parts 0 and 2, the odd from 1 and 3
        acc0 = tl.reshape(tl.permute(tl.join(acc0, acc2), (0, 2, 1)), [D // 2, BLOCK_H])
        acc1 = tl.reshape(tl.permute(tl.join(acc1, acc3), (0, 2, 1)), [D // 2, BLOCK_H])
    if VALUE_REF:
        acc0 *= v_ref
        acc1 *= v_ref
    if KEYS_AS_ROWS:
        acc0 = tl.trans(acc0)
        acc1 = tl.trans(acc1)
    if OFFSETS_APART and V_FMT == 5:  # the cold keys' value offsets, at the same running max
        acc0 += o_i[:, None]
        acc1 += o_i[:, None]
    if split == tail_split:  # sinks, ring and the new key (slot 0's rows): the last split of the pass
        n = tl.arange(0, TAIL_N)
        first = slot == 0
        if TAIL_T:  # the whole query and output, turned over: [D, rows] (acc1 unused until split back)
            qd0 = tl.trans(tl.reshape(tl.join(q0, q1), [BLOCK_H, D]).to(DOT_DTYPE))
            qd1 = qd0
            acc0 = tl.trans(tl.reshape(tl.join(acc0, acc1), [BLOCK_H, D]))  # channel 2c + i from acc_i
            acc1 = acc0
        else:
            qd0 = q0.to(DOT_DTYPE)
            qd1 = q1.to(DOT_DTYPE)
        if HAS_SINKS:
            sink_len = tl.load(SINK_OK + b) * P  # P keys when the sequence has a sink page, else 0
            sink = tl.load(ST + b).to(tl.int64)
            for j0 in range(0, sink_len, TAIL_N):
                ok = j0 + n < sink_len
                acc0, acc1, m_i, l_i = _tail_keys(
                    qd0, qd1, acc0, acc1, m_i, l_i, SK, SV, (sink * P + j0 + n) * H + h, ok, first,
                    D, DOT_PREC, TAIL_ROWS, TAIL_T,
                )  # fmt: skip
        ring_len = tl.load(RING_LEN + b)
        rr = RR + b * rr_stride
        if TABLE_AHEAD:  # the ring rows a tile ahead too
            ring_row = tl.load(rr + n, mask=n < ring_len, other=0).to(tl.int64)
        for j0 in range(0, ring_len, TAIL_N):
            ok = j0 + n < ring_len
            if TABLE_AHEAD:
                ahead = j0 + TAIL_N + n
                row_ahead = tl.load(rr + ahead, mask=ahead < ring_len, other=0).to(tl.int64)
            else:
                ring_row = tl.load(rr + j0 + n, mask=ok, other=0).to(tl.int64)
            acc0, acc1, m_i, l_i = _tail_keys(
                qd0, qd1, acc0, acc1, m_i, l_i, RK, RV, ring_row * H + h, ok, first,
                D, DOT_PREC, TAIL_ROWS, TAIL_T,
            )  # fmt: skip
            if TABLE_AHEAD:
                ring_row = row_ahead
        ok = n < 1
        acc0, acc1, m_i, l_i = _tail_keys(
            qd0, qd1, acc0, acc1, m_i, l_i, KN, VN, (b + n).to(tl.int64) * H + h, ok, first,
            D, DOT_PREC, TAIL_ROWS, TAIL_T,
        )  # fmt: skip
        if TAIL_T:  # back to the even and odd channel halves, [rows, D/2]
            acc0, acc1 = tl.split(tl.reshape(tl.trans(acc0), [BLOCK_H, D // 2, 2]))

    if BLOCK_H > SLOT_R:  # merge the slots' softmax states: one per query head
        m_s = tl.reshape(m_i, [BLOCK_H // SLOT_R, SLOT_R])
        m_i = tl.max(m_s, 0)
        f = tl.exp2(m_s - m_i[None, :])
        l_i = tl.sum(tl.reshape(l_i, [BLOCK_H // SLOT_R, SLOT_R]) * f, 0)
        acc0 = tl.sum(tl.reshape(acc0, [BLOCK_H // SLOT_R, SLOT_R, D // 2]) * f[:, :, None], 0)
        acc1 = tl.sum(tl.reshape(acc1, [BLOCK_H // SLOT_R, SLOT_R, D // 2]) * f[:, :, None], 0)
        r = tl.arange(0, SLOT_R)
        row_ok = r < GROUP
        q_row = (b * H + h).to(tl.int64) * GROUP + r
    if SPLIT:
        has = l_i > 0
        inv = 1.0 / tl.where(has, l_i, 1.0)
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        o_at = PO + (q_row * num_splits + split)[:, None] * D
        tl.store(PL + q_row * num_splits + split, lse, mask=row_ok)
    else:
        inv = 1.0 / l_i
        o_at = OUT + q_row[:, None] * D
    tl.store(o_at + c0[None, :], (acc0 * inv[:, None]).to(o_at.dtype.element_ty), mask=row_ok[:, None])
    tl.store(o_at + c1[None, :], (acc1 * inv[:, None]).to(o_at.dtype.element_ty), mask=row_ok[:, None])
    if MERGE_S > 0:  # the last split of this sequence and KV head merges them all into OUT
        merge_if_last(COUNT, PO, PL, OUT, b, h, H, num_splits, GROUP, D, MERGE_G, MERGE_S, BLOCK_D)


def decode4_options(group: int, launch: dict, interpreted: bool, meta: dict) -> dict:
    """`_decode4_kernel`'s keyword arguments, with `decode.decode_options`' ``meta`` (its runtime
    arguments and grid are those of `_decode_kernel`); ``launch`` the `DECODE_LAUNCH` entry
    (``blocks``: 16-token blocks a tile, ``num_warps``, ``num_stages``, ``asm``: packed PTX decoding
    where the operands are FP16, ``maxnreg``: a register cap per thread, or None, ``fold_key_scales``:
    the keys' scales folded into the query per block, ``SLOT_R`` rows a block: the group padded to
    a power of two, and to 16 rows over the tile's blocks), ``heads_together``: program ids remapped
    so that consecutive programs are the KV heads of one sequence (the same grid), ``tail_rows``:
    the decode tail's rows loaded whole (`_tail_tile`), ``value_offsets_apart``: int4 value offsets
    summed per row (`_cold_tile4`); the last three off unless set (docs/kernels-h200.md, pass 8);
    ``keys_as_rows`` (with ``fold_key_scales`` only; the slots padded to 8 rows in all, not 16: the
    query side is then the product's N, whose tensor-core minimum is 8) and ``value_reference``
    (`_cold_tile4`; pass 9), off unless set; ``value_quads`` (with ``keys_as_rows``; head_dim 64 or
    more, else ignored): the value codes as 16-bit elements (`_cold_tile4`; pass 12);
    ``table_ahead``: page-table entries loaded a tile ahead, the tile's scales in it (unlike
    ``prefetch``, which also loads the scales ahead and takes precedence; with three stages
    Triton's pipeliner then keeps the next tile's code copies in flight through the tile; the ring
    rows likewise, a tail tile ahead: pass 17); ``wide_scales`` (with ``fold_key_scales``): fp4 key
    block scales read as channel pairs (`_folded_query`); both off unless set; ``tail_n``: keys a
    tile of the decode tail (`TAIL_N` unless set); ``tail_keys_as_rows``: the decode tail's tiles
    turned over (`_tail_tile_t`), off unless set; ``magic_codes``: int4 codes with their FP16 offsets,
    taken off in the products (`_cold_tile4`; int4 keys and values with ``keys_as_rows``,
    ``value_quads`` and ``value_reference`` only, else ignored), off unless set. Operands are FP16 for
    16-bit models on a GPU, else float32 (``interpreted``, float32 models)."""
    f16 = not interpreted and meta["DOT_DTYPE"] in (tl.bfloat16, tl.float16)
    fold = bool(launch.get("fold_key_scales"))
    keys_as_rows = bool(launch.get("keys_as_rows"))
    if keys_as_rows and not fold:
        raise ValueError("decode4: keys_as_rows needs fold_key_scales")
    if launch.get("wide_scales") and not fold:
        raise ValueError("decode4: wide_scales needs fold_key_scales")
    tail_n = launch.get("tail_n", TAIL_N)
    if tail_n < 16 or tail_n & (tail_n - 1):  # the tail's P.V product has K = tail_n (>= 16 on a GPU)
        raise ValueError(f"decode4: tail_n must be a power of two of at least 16, not {tail_n}")
    value_quads = bool(launch.get("value_quads"))
    if value_quads and not keys_as_rows:
        raise ValueError("decode4: value_quads needs keys_as_rows")
    value_quads = value_quads and meta["D"] >= 64  # parts of D/4 >= 16 channels: the product's M
    magic = bool(launch.get("magic_codes")) and meta["K_FMT"] == meta["V_FMT"] == INT4_FORMAT
    magic = magic and keys_as_rows and value_quads and bool(launch.get("value_reference"))
    least = 8 if keys_as_rows else 16  # a tile's query rows at least: the product's N, or its M
    rows = max(triton.next_power_of_2(group), least // launch["blocks"])  # a block's rows with ``fold``
    block_h = rows * launch["blocks"] if fold else max(16, triton.next_power_of_2(group))
    options = dict(
        meta,
        CODE_DTYPE=tl.float16 if f16 else tl.float32,
        GROUP=group,
        BLOCK_H=block_h,
        BLOCKS=launch["blocks"],
        PREFETCH=bool(launch.get("prefetch")),
        TABLE_AHEAD=bool(launch.get("table_ahead")),
        WIDE_SCALES=bool(launch.get("wide_scales")),
        TAIL_N=tail_n,
        ASM=bool(launch.get("asm")) and f16,
        FOLD=fold,
        SLOT_R=rows if fold else block_h,
        HEADS_TOGETHER=bool(launch.get("heads_together")),
        TAIL_ROWS=bool(launch.get("tail_rows")),
        TAIL_T=bool(launch.get("tail_keys_as_rows")),
        OFFSETS_APART=bool(launch.get("value_offsets_apart")),
        KEYS_AS_ROWS=keys_as_rows,
        VALUE_REF=bool(launch.get("value_reference")),
        VALUE_QUADS=value_quads,
        MAGIC=magic,
        num_warps=launch["num_warps"],
        num_stages=launch["num_stages"],
    )
    if launch.get("maxnreg"):
        options["maxnreg"] = launch["maxnreg"]
    return options
