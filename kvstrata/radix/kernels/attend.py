"""Triton attention over the strata: cold pages decoded in registers, the sink page, ring rows, new tokens.

One program takes ``BLOCK_M`` query rows of one sequence and one KV head; rows are (token, query head
of the group) so a KV head's keys are read once for all the query heads that share it (GQA). It walks
the sequence's keys in the order the torch reference concatenates them: cold pages through the page
table (codes + scales decoded by `kvstrata.quant.kernel_decode`), the sink page, the ring rows, then
the step's new tokens (causal among themselves), with one online softmax in float32. Q·K and P·V run
on the tensor cores in the model dtype (BF16 in, float32 accumulate; IEEE float32 for a float32 model).

Split-KV: when a step has too few (sequence, head) pairs to fill the GPU (decode at small batch), the
cold pages of each sequence are cut into ``splits`` ranges; each program writes its partial output
and log-sum-exp, and `_merge` combines them. The last split also reads sink, ring and new tokens, so
every row has at least one key in it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.quant.kernel_decode import kernel_format, load_decoded
from kvstrata.radix.plan import GroupPlan, StepBatch
from kvstrata.radix.pool import ColdPool, as_raw
from kvstrata.radix.ring import HotRing
from kvstrata.radix.sinks import SinkStore

LOG2E = 1.4426950408889634
BLOCK_N = 32  # keys per iteration (a multiple of 16: tensor-core tile)
TARGET_PROGRAMS = 512  # split-KV aims at about this many programs (a few per SM on an H100/H200)
MIN_PAGES_PER_SPLIT = 16
_DOT_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _update(q, k, v, ok, acc, m_i, l_i, qk_scale, DOT_PREC: tl.constexpr):
    """One online-softmax step over a key tile (``ok``: [BLOCK_M, BLOCK_N] visible keys); ``q`` is
    already in the dot's operand dtype."""
    s = tl.dot(q, tl.trans(k.to(q.dtype)), input_precision=DOT_PREC) * qk_scale
    s = tl.where(ok, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision=DOT_PREC)
    return acc, m_new, l_i


@triton.jit
def _attend_kernel(
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
    DOT_PREC: tl.constexpr,
    DOT_DTYPE: tl.constexpr,
):
    m_blocks = tl.cdiv(T * GROUP, BLOCK_M)
    b = tl.program_id(0) // m_blocks
    mb = tl.program_id(0) % m_blocks
    h = tl.program_id(1)
    split = tl.program_id(2)
    hq = H * GROUP

    r = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    t = r // GROUP
    row_ok = t < T
    q_row = (b * T + t).to(tl.int64) * hq + h * GROUP + r % GROUP
    d = tl.arange(0, BLOCK_D)
    d_ok = d < D
    q = tl.load(Q + q_row[:, None] * D + d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)
    q = q.to(DOT_DTYPE)

    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n = tl.arange(0, BLOCK_N)

    # Cold pages [lo, hi) of this split, token by token (any page size).
    n_cold = tl.load(COLD_LEN + b)
    lo = split * pages_per_split
    hi = tl.minimum(lo + pages_per_split, n_cold)
    for j0 in range(lo * P, hi * P, BLOCK_N):
        j = j0 + n
        ok = j < hi * P
        page = tl.load(PT + b * pt_stride + j // P, mask=ok, other=0).to(tl.int64)
        tok = (j % P).to(tl.int64)
        valid = ok[:, None] & d_ok[None, :]
        pg, tk, dd, rok = page[:, None], tok[:, None], d[None, :], ok[:, None]
        k = load_decoded(K0, K1, K2, pg, tk, h, dd, valid, rok, H, P, D, BLOCK_D, K_FMT, True)
        v = load_decoded(V0, V1, V2, pg, tk, h, dd, valid, rok, H, P, D, BLOCK_D, V_FMT, False)
        acc, m_i, l_i = _update(q, k, v, ok[None, :], acc, m_i, l_i, qk_scale, DOT_PREC)

    if split == num_splits - 1:
        if HAS_SINKS:
            sink_len = tl.load(SINK_OK + b) * P  # P keys when the sequence has a sink page, else 0
            slot = tl.load(ST + b).to(tl.int64)
            for j0 in range(0, sink_len, BLOCK_N):
                j = j0 + n
                ok = j < sink_len
                off = ((slot * P + j) * H + h)[:, None] * D + d[None, :]
                valid = ok[:, None] & d_ok[None, :]
                k = tl.load(SK + off, mask=valid, other=0.0)
                v = tl.load(SV + off, mask=valid, other=0.0)
                acc, m_i, l_i = _update(q, k, v, ok[None, :], acc, m_i, l_i, qk_scale, DOT_PREC)
        ring_len = tl.load(RING_LEN + b)
        for j0 in range(0, ring_len, BLOCK_N):
            j = j0 + n
            ok = j < ring_len
            ring_row = tl.load(RR + b * rr_stride + j, mask=ok, other=0).to(tl.int64)
            off = (ring_row * H + h)[:, None] * D + d[None, :]
            valid = ok[:, None] & d_ok[None, :]
            k = tl.load(RK + off, mask=valid, other=0.0)
            v = tl.load(RV + off, mask=valid, other=0.0)
            acc, m_i, l_i = _update(q, k, v, ok[None, :], acc, m_i, l_i, qk_scale, DOT_PREC)
        # New tokens, causal: row of token t sees new tokens 0..t; none past this block's last token.
        last = tl.minimum(T, (mb * BLOCK_M + BLOCK_M - 1) // GROUP + 1)
        for j0 in range(0, last, BLOCK_N):
            j = j0 + n
            ok = j < T
            off = ((b * T + j).to(tl.int64) * H + h)[:, None] * D + d[None, :]
            valid = ok[:, None] & d_ok[None, :]
            k = tl.load(KN + off, mask=valid, other=0.0)
            v = tl.load(VN + off, mask=valid, other=0.0)
            seen = ok[None, :] & (j[None, :] <= t[:, None])
            acc, m_i, l_i = _update(q, k, v, seen, acc, m_i, l_i, qk_scale, DOT_PREC)

    out_mask = row_ok[:, None] & d_ok[None, :]
    if SPLIT:
        has = l_i > 0
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
        tl.store(PO + (q_row * num_splits + split)[:, None] * D + d[None, :], o, mask=out_mask)
        tl.store(PL + q_row * num_splits + split, lse, mask=row_ok)
    else:
        o = acc / l_i[:, None]
        tl.store(OUT + q_row[:, None] * D + d[None, :], o.to(OUT.dtype.element_ty), mask=out_mask)


@triton.jit
def _merge_kernel(PO, PL, OUT, num_splits, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    """Combine the splits of one (token, query head) row by their base-2 log-sum-exp."""
    row = tl.program_id(0).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    d = tl.arange(0, BLOCK_D)
    s_ok = s < num_splits
    lse = tl.load(PL + row * num_splits + s, mask=s_ok, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    o = tl.load(
        PO + (row * num_splits + s)[:, None] * D + d[None, :],
        mask=s_ok[:, None] & (d < D)[None, :],
        other=0.0,
    )
    out = tl.sum(o * w[:, None], 0) / tl.sum(w, 0)
    tl.store(OUT + row * D + d, out.to(OUT.dtype.element_ty), mask=d < D)


def _num_splits(programs: int, max_pages: int) -> int:
    """Splits of the cold pages so that about `TARGET_PROGRAMS` programs run, each with at least
    `MIN_PAGES_PER_SPLIT` pages."""
    if max_pages < 2 * MIN_PAGES_PER_SPLIT or programs >= TARGET_PROGRAMS:
        return 1
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, programs), max_pages // MIN_PAGES_PER_SPLIT))


def attend_group(
    layer: int,
    g: GroupPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    splits: int | None = None,
) -> torch.Tensor:
    """``[B*T, Hq, D]`` outputs (q's dtype) of one group: q ``[B*T, Hq, D]``, k/v ``[B*T, H, D]`` (the
    group's rows, contiguous). ``splits`` overrides the split-KV heuristic (tests)."""
    B, T = g.batch, g.tokens
    _, hq, d = q.shape
    h = k.shape[1]
    group = hq // h
    # A layer may store keys and values in different codecs (a precision plan's "int4/fp4_e2m1").
    k_fmt, k_names = kernel_format(pool.k_codecs[layer])
    v_fmt, v_names = kernel_format(pool.v_codecs[layer])
    kp = [as_raw(pool.k[layer][name]) for name in k_names]
    vp = [as_raw(pool.v[layer][name]) for name in v_names]
    kp += [kp[0]] * (3 - len(kp))
    vp += [vp[0]] * (3 - len(vp))
    lengths = g.kernel_lengths
    n_pages = g.page_table.shape[1]
    # Decode: one tile of query rows; extend: wider tiles so each decoded key tile serves more rows.
    block_m = max(16, min(128 if T > 1 else 64, triton.next_power_of_2(T * group)))
    block_n = 64 if T > 1 else BLOCK_N
    m_blocks = triton.cdiv(T * group, block_m)
    if splits is None:
        splits = _num_splits(B * h * m_blocks, n_pages) if T == 1 else 1
    pages_per_split = triton.cdiv(max(n_pages, 1), splits)
    out = torch.empty_like(q)
    po = pl = out
    if splits > 1:
        po = torch.empty((B * T, hq, splits, d), dtype=torch.float32, device=q.device)
        pl = torch.empty((B * T, hq, splits), dtype=torch.float32, device=q.device)
    if sinks is not None and g.sink_table is not None:
        sink_args = (g.sink_table, lengths[2], sinks.k[layer], sinks.v[layer])
    else:
        sink_args = (lengths[2], lengths[2], ring.k[layer], ring.v[layer])
    block_d = triton.next_power_of_2(d)
    interpreted = q.device.type == "cpu"
    _attend_kernel[(B * m_blocks, h, splits)](
        q,
        k,
        v,
        out,
        po,
        pl,
        g.page_table,
        lengths[0],
        *kp,
        *vp,
        *sink_args,
        g.ring_rows,
        lengths[1],
        ring.k[layer],
        ring.v[layer],
        scale * LOG2E,
        T,
        h,
        g.page_table.stride(0),
        g.ring_rows.stride(0),
        pages_per_split,
        splits,
        GROUP=group,
        D=d,
        BLOCK_D=block_d,
        P=pool.page_size,
        K_FMT=k_fmt,
        V_FMT=v_fmt,
        HAS_SINKS=sinks is not None and g.sink_table is not None,
        SPLIT=splits > 1,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_PREC="ieee" if q.dtype == torch.float32 or interpreted else "tf32",
        # The interpreter's BF16 dot is wrong (Triton 3.9): on CPU the operands go float32.
        DOT_DTYPE=tl.float32 if interpreted else _DOT_DTYPES[q.dtype],
        num_warps=8 if block_m >= 128 else 4,
    )
    if splits > 1:
        _merge_kernel[(B * T * hq,)](
            po, pl, out, splits, D=d, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(splits)
        )
    return out


def _take(x: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    return (x if rows is None else x.index_select(0, rows)).contiguous()


def attend(
    layer: int,
    batch: StepBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over each sequence's strata: ``[T, Hq, D]`` in q's
    dtype, as `kvstrata.radix.attention.attend` computes it (same plan, same order of keys)."""
    if len(batch.groups) == 1 and batch.groups[0].rows is None:
        g = batch.groups[0]
        return attend_group(
            layer, g, _take(q, None), _take(k, None), _take(v, None), scale, pool, ring, sinks
        )
    out = torch.empty_like(q)
    for g in batch.groups:
        got = attend_group(
            layer, g, _take(q, g.rows), _take(k, g.rows), _take(v, g.rows), scale, pool, ring, sinks
        )
        out.index_copy_(0, g.rows, got)
    return out
