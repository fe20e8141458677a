"""Triton page quantize: the pages a step completes, encoded from ring rows + new rows straight into
the pool's parts (and the sink store), one program per (page, KV head), no gathered float copy.

Codes equal the torch codecs' (`kvstrata.quant.kernel_encode` mirrors them operation for operation).
Each program also reports the finite absmax and the NaN/Inf count of its K and V rows, which the cache
accumulates as the torch path does. Static clips (calibration scales) are not handled here: the cache
keeps the torch path for them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvstrata.quant.kernel_encode import encode_store, store_pairs, to_storage
from kvstrata.radix.attention import layer_kv, write_ring
from kvstrata.radix.kernels.jit import jit_unspecialized
from kvstrata.radix.plan import StepBatch, WritePlan
from kvstrata.radix.pool import ColdPool, WriteCounts, as_raw
from kvstrata.radix.ring import HotRing
from kvstrata.radix.sinks import SinkStore

# Warps a (page, head) program, by the format that wants more of them, K's or V's (`kernel_format` ids;
# the 4-bit and int8 encoders keep 4, and fp32 rows share BF16's entry: not timed). H200, 8B layer, one
# prefill step's 480 pages of 5 fresh 1,536-token prompts, `quantize_pages` alone by CUDA events (one
# run, 2026-12-04): BF16 rows 47 us a layer at 1 warp against 68 at 4 (70 at 2, 82 at 8); FP8 E4M3 84 at
# 2 against 99 at 4 (86 at 1).
QUANTIZE_WARPS = {0: 1, 1: 2, 2: 2}


def quantize_warps(k_fmt: int, v_fmt: int) -> int:
    return max(QUANTIZE_WARPS.get(k_fmt, 4), QUANTIZE_WARPS.get(v_fmt, 4))


def as_bits(t: torch.Tensor) -> torch.Tensor:
    """A buffer as the kernel writes it: BF16 as int16 bits (see `to_storage`), FP8 as uint8."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else as_raw(t)


@triton.jit
def _load_rows(
    RING, NEW, ring_row, new_row, from_ring, row_ok, H, h, D: tl.constexpr, BLOCK_D2: tl.constexpr
):
    """float32 even and odd channels ``[BLOCK_P, BLOCK_D2]`` of one head's rows ``row_ok``, each row
    from the ring or from the new K/V. Rows load whole (contiguous channels: vector loads) and split
    into the halves in registers."""
    c = tl.arange(0, 2 * BLOCK_D2)[None, :]
    ok = row_ok & (c < D)
    r = tl.load(RING + (ring_row * H + h) * D + c, mask=ok & from_ring, other=0.0).to(tl.float32)
    n = tl.load(NEW + (new_row * H + h) * D + c, mask=ok & (from_ring == 0), other=0.0).to(tl.float32)
    return tl.split(tl.reshape(tl.where(from_ring, r, n), [r.shape[0], BLOCK_D2, 2]))


@triton.jit
def _nonfinite(x):
    return (x != x) | (tl.abs(x) > 3.4028234663852886e38)


@triton.jit
def _quantize_head(
    RING,
    NEW,
    ring_row,
    new_row,
    from_ring,
    tok,
    i,
    p0,
    p1,
    p2,
    SINK,
    sink_slot,
    STATS,
    stat_off,
    page,
    h,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    FMT: tl.constexpr,
    CHANNEL: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    ok = (tok < P) & (2 * i < D)
    xe, xo = _load_rows(RING, NEW, ring_row, new_row, from_ring, tok < P, H, h, D, BLOCK_D2)
    bad_e = _nonfinite(xe) & ok
    bad_o = _nonfinite(xo) & ok
    if FMT == 0:  # raw storage keeps NaN/Inf as they are, like the torch raw codecs
        ty = p0.dtype.element_ty
        store_pairs(
            p0, (page * P + tok) * H + h, to_storage(xe, ty), to_storage(xo, ty), tok < P, D, BLOCK_D2
        )
    else:  # the codecs' input preparation: NaN/Inf count and become 0 before any scale
        encode_store(
            tl.where(bad_e, 0.0, xe),
            tl.where(bad_o, 0.0, xo),
            p0,
            p1,
            p2,
            page,
            h,
            H,
            P,
            D,
            BLOCK_P,
            BLOCK_D2,
            FMT,
            CHANNEL,
        )
    if HAS_SINKS:
        s_ok = (tok < P) & (tok * 0 + sink_slot >= 0)  # (a scalar bool in a mask trips the interpreter)
        ty = SINK.dtype.element_ty
        store_pairs(
            SINK, (sink_slot * P + tok) * H + h, to_storage(xe, ty), to_storage(xo, ty), s_ok, D, BLOCK_D2
        )
    amax = tl.max(
        tl.max(tl.maximum(tl.abs(tl.where(bad_e, 0.0, xe)), tl.abs(tl.where(bad_o, 0.0, xo))), 1), 0
    )
    nonfinite = tl.sum(tl.sum(bad_e.to(tl.float32) + bad_o.to(tl.float32), 1), 0)
    tl.store(STATS + stat_off, amax)
    tl.store(STATS + stat_off + 1, nonfinite)


@jit_unspecialized(
    ints=("n_pages", "n_rows"), pointers=("SRC", "PAGE_IDS", "SINK_SLOTS", "RING_DST", "RING_SRC")
)
def _page_quantize_kernel(
    RK,
    RV,
    KN,
    VN,
    SRC,
    PAGE_IDS,
    SINK_SLOTS,
    RING_DST,
    RING_SRC,
    n_pages,
    n_rows,
    K0,
    K1,
    K2,
    V0,
    V1,
    V2,
    SK,
    SV,
    STATS,
    H,
    P: tl.constexpr,
    D: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_D2: tl.constexpr,
    K_FMT: tl.constexpr,
    V_FMT: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    """Program ``(w, h)``: entry ``w`` of ``PAGE_IDS`` (``w < n_pages``), head ``h``; then, where ``w <
    n_rows``, head ``h`` of new row ``RING_SRC[w]`` copied into ring row ``RING_DST[w]``
    (`ring_rows_fused`: no program reads a ring row another one writes)."""
    w = tl.program_id(0)
    h = tl.program_id(1)
    # The new row's loads issue first, so that their latency overlaps the page's. Its indices load in
    # every lane (a scalar mask trips the interpreter).
    c = tl.arange(0, 2 * BLOCK_D2)
    c_ok = (c < D) & (c * 0 + w < n_rows)
    at_new = (tl.load(RING_SRC + w + c * 0, mask=c_ok, other=0).to(tl.int64) * H + h) * D + c
    new_k = tl.load(KN + at_new, mask=c_ok)
    new_v = tl.load(VN + at_new, mask=c_ok)
    dst = tl.load(RING_DST + w + c * 0, mask=c_ok, other=0).to(tl.int64)
    if w < n_pages:
        page = tl.load(PAGE_IDS + w).to(tl.int64)
        stat = (w * H + h) * 4
        if page < 0:  # an entry of a static (CUDA-graph) grid that completes no page: nothing to write
            tl.store(STATS + stat + tl.arange(0, 4), tl.zeros((4,), tl.float32))
        else:
            tok = tl.arange(0, BLOCK_P)[:, None]
            i = tl.arange(0, BLOCK_D2)[None, :]
            # SRC: >= 0 a ring row, < 0 the new row -1 - SRC.
            src = tl.load(SRC + w * P + tok, mask=tok < P, other=0)
            from_ring = src >= 0
            ring_row = tl.where(from_ring, src, 0)
            new_row = tl.where(from_ring, 0, -1 - src)
            sink_slot = tl.load(SINK_SLOTS + w).to(tl.int64)
            _quantize_head(
                RK, KN, ring_row, new_row, from_ring, tok, i, K0, K1, K2, SK, sink_slot, STATS, stat,
                page, h, H, P, D, BLOCK_P, BLOCK_D2, K_FMT, True, HAS_SINKS,
            )  # fmt: skip
            _quantize_head(
                RV, VN, ring_row, new_row, from_ring, tok, i, V0, V1, V2, SV, sink_slot, STATS, stat + 2,
                page, h, H, P, D, BLOCK_P, BLOCK_D2, V_FMT, False, HAS_SINKS,
            )  # fmt: skip
    at_ring = (dst * H + h) * D + c
    tl.store(RK + at_ring, new_k, mask=c_ok)
    tl.store(RV + at_ring, new_v, mask=c_ok)


def quantize_pages(
    layer: int,
    w: WritePlan,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
    ring_rows: bool = False,
) -> torch.Tensor | None:
    """Encode the step's completed pages of ``layer`` into the pool (and sinks); ``k``/``v`` are the
    step's new rows ``[T, H, D]``. Must run before the new rows are written to the ring, unless the
    first launch writes them itself (``ring_rows``, where `ring_rows_fused`: new row ``w.ring_src[i]``
    into ring row ``w.ring_dst[i]``). Image pages (``w.image_split``) go to ``image_pool`` and
    raised pages (``w.raised_split``) to ``raised_pool``, one launch per pool.

    Returns what the encoder counted, one ``[H, 4]`` float32 row per page (`reduce_counts` makes
    them ``[2, 2]``), on the device and read by nobody until the caller wants it (no host sync and
    no reduction per layer); None when no page completes."""
    P = pool.page_size
    src, sink_slots = w.kernel_sources(P), w.kernel_sink_slots
    has_sinks = sinks is not None and w.sink_pages.numel() > 0
    stats = None
    for which, page_ids, target in w.pool_writes(pool, image_pool, raised_pool):
        rows_src, slots = src, sink_slots
        if which is not None:  # some of the step's pages: their rows and sink slots
            rows_src = src.view(-1, P).index_select(0, which).view(-1)
            slots = sink_slots.index_select(0, which)
        writes = (w.ring_src, w.ring_dst) if ring_rows else None
        part = _quantize(layer, page_ids, rows_src, slots, has_sinks, k, v, target, ring, sinks, writes)
        stats = _merge_counts(stats, part)
        ring_rows = False
    return stats


def _merge_counts(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | None:
    """The device counts of two launches: their pages' rows together."""
    if a is None or b is None:
        return b if a is None else a
    return torch.cat((a, b))


def reduce_counts(stats: torch.Tensor) -> torch.Tensor:
    """``[..., 2, 2]`` of `quantize_pages`' rows ``[..., pages, H, 4]``: rows (finite absmax, NaN/Inf
    elements), columns (K, V), over the pages and heads."""
    return torch.stack((stats[..., 0::2].amax(dim=(-3, -2)), stats[..., 1::2].sum(dim=(-3, -2))), dim=-2)


def _quantize(
    layer: int,
    page_ids: torch.Tensor,
    src: torch.Tensor,
    sink_slots: torch.Tensor,
    has_sinks: bool,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    ring_writes: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """One launch: pages ``page_ids`` of ``pool`` from the rows ``src`` (see `WritePlan.kernel_sources`),
    each page also filling its sink slot (``sink_slots``, -1: none), and with ``ring_writes`` (rows of
    k/v, their ring rows) those new rows written into the ring; its device counts, as
    `quantize_pages` returns them (None: no page)."""
    from kvstrata.quant.kernel_decode import kernel_format

    n = page_ids.numel()
    ring_src, ring_dst = (page_ids, page_ids) if ring_writes is None else ring_writes
    rows = ring_dst.numel() if ring_writes is not None else 0
    if n == 0 and rows == 0:
        return None
    k_fmt, k_names = kernel_format(pool.k_codecs[layer])
    v_fmt, v_names = kernel_format(pool.v_codecs[layer])
    kp = [as_bits(pool.k[layer][name]) for name in k_names]
    vp = [as_bits(pool.v[layer][name]) for name in v_names]
    kp += [kp[0]] * (3 - len(kp))
    vp += [vp[0]] * (3 - len(vp))
    P, (_, _, H, D) = pool.page_size, ring.k.shape
    sk, sv = (as_bits(sinks.k[layer]), as_bits(sinks.v[layer])) if has_sinks and sinks is not None else (k, v)
    stats = torch.empty((n, H, 4), dtype=torch.float32, device=k.device)
    _page_quantize_kernel[(max(n, rows), H)](
        *layer_kv(ring, layer),
        k.contiguous(),
        v.contiguous(),
        src,
        page_ids,
        sink_slots,
        ring_dst,
        ring_src,
        n,
        rows,
        *kp,
        *vp,
        sk,
        sv,
        stats,
        H,
        P=P,
        D=D,
        BLOCK_P=max(16, triton.next_power_of_2(P)),
        BLOCK_D2=max(8, triton.next_power_of_2(D) // 2),
        K_FMT=k_fmt,
        V_FMT=v_fmt,
        HAS_SINKS=has_sinks,
        num_warps=quantize_warps(k_fmt, v_fmt),
    )
    return stats if n else None


def write_counts(stats: torch.Tensor | None) -> WriteCounts:
    """`WriteCounts` of `quantize_pages`' device counts (reads them back: a host sync)."""
    if stats is None:
        return WriteCounts()
    (absmax_k, absmax_v), (bad_k, bad_v) = reduce_counts(stats).tolist()
    return WriteCounts(0, 0, int(bad_k), int(bad_v), absmax_k, absmax_v)


def store_async(
    layer: int,
    batch: StepBatch,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
) -> torch.Tensor | None:
    """`kvstrata.radix.attention.store` with the Triton encoder: the step's completed pages are
    quantized from the ring and the new rows, then the new rows go into the ring, in the encoder's
    launch where `ring_rows_fused` allows. Returns the encoder's counts on the device
    (`quantize_pages`), so nothing waits for the device."""
    fused = ring_rows_fused(batch, k, ring, pool.page_size)
    stats = quantize_pages(layer, batch.write, k, v, pool, ring, sinks, image_pool, raised_pool, fused)
    if not fused:
        write_ring(layer, batch, k, v, ring)
    return stats


def ring_rows_fused(batch: StepBatch, k: torch.Tensor, ring: HotRing, page_size: int) -> bool:
    """Whether the page-quantize launch can write the step's new rows into the ring itself, instead of
    `write_ring`'s two copies after it (a decode step: 64 fewer kernels at 32 layers). It can where no
    program's ring write lands on a row another program reads: one new token a sequence and at least
    a page of ring rows a sequence, so that token L's row (L mod capacity), where it is kept, is none
    of the rows its completing page reads (L-P+1 to L-1; other sequences' rows are other slots';
    padded entries of a static step write rows no page reads). The new rows copy as they are: the
    ring's dtype must be theirs."""
    return batch.one_token_each and ring.capacity >= page_size and ring.k.dtype == k.dtype


def store(
    layer: int,
    batch: StepBatch,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
) -> WriteCounts:
    """`store_async` with the counts read back as `WriteCounts`."""
    return write_counts(store_async(layer, batch, k, v, pool, ring, sinks, image_pool, raised_pool))
