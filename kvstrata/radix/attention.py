"""Reference attention over the strata: cold pages (dequantized), sinks, ring and the new tokens.

Sequences of a group (equal numbers of new tokens) are attended as one padded batch, with queries
laid out ``[B, kv_heads, group * T, D]``: the ``group`` query heads of a KV head become query rows of
that head, so each KV head's keys are read once. When a group's cold history fits in
``block_pages`` pages, its keys are gathered once as ``[cold | sinks | ring | new]`` and attended in
a single ``scaled_dot_product_attention`` call with an additive mask built once per step. Longer
histories take the block-wise path: an online softmax whose running max ``m``, denominator ``l`` and
numerator ``acc`` are rescaled as each block of at most ``block_pages`` pages arrives, so the history
is never dequantized as a whole.

Image pages kept in a pool of their own (``image_pool``, the vision codec) are one more key
segment after the text pages: ``[cold | image | sinks | ring | new]`` in the single pass, one more
run of blocks in the online softmax. Raised pages (``raised_pool``, the drift fallback's wider codecs)
are one more after them: ``[cold | image | raised | sinks | ring | new]``.

Padded slots read zero rows kept for that purpose (see `GroupPlan`), so masked keys and values are
finite: one sequence's NaN/Inf never reaches another sequence of its batch.
"""

from __future__ import annotations

from typing import Any
from weakref import WeakKeyDictionary

import torch
import torch.nn.functional as F

from kvstrata.radix.plan import GroupPlan, StepBatch
from kvstrata.radix.pool import ColdPool, WriteCounts
from kvstrata.radix.ring import HotRing
from kvstrata.radix.sinks import SinkStore

COMPUTE = torch.float32


class OnlineSoftmax:
    """softmax(q k^T + bias) v accumulated over key segments ``[B, S, Hkv, D]``."""

    def __init__(self, q: torch.Tensor) -> None:
        self.q = q  # [B, Hkv, rows, D], already scaled
        shape = (*q.shape[:-1], 1)
        self.m = torch.full(shape, float("-inf"), dtype=COMPUTE, device=q.device)
        self.l = torch.zeros(shape, dtype=COMPUTE, device=q.device)
        self.acc = torch.zeros_like(q)

    def update(self, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> None:
        s = self._scores(k)
        s += bias
        m_new = torch.maximum(self.m, s.amax(dim=-1, keepdim=True))
        # A row that has seen only masked keys keeps m = -inf; shift by 0 there to avoid inf - inf.
        shift = torch.where(torch.isneginf(m_new), 0.0, m_new)
        p = torch.exp(s - shift)
        alpha = torch.exp(self.m - shift)
        self.l = self.l * alpha + p.sum(dim=-1, keepdim=True)
        self.acc = self.acc * alpha + torch.matmul(p, v.permute(0, 2, 1, 3))
        self.m = m_new

    def _scores(self, k: torch.Tensor) -> torch.Tensor:
        """``q k^T`` as ``[B, Hkv, rows, S]``. One batched matmul per KV head: ``k[:, :, h]`` is a
        strided view BLAS reads in place, where a single 4-D matmul would first copy K into
        head-major order (measured: 1.5 ms vs 0.6 ms for 8 x 1,000 keys x 3 heads)."""
        b, hkv, rows, _ = self.q.shape
        s = torch.empty((b, hkv, rows, k.shape[1]), dtype=COMPUTE, device=k.device)
        for h in range(hkv):
            torch.bmm(self.q[:, h], k[:, :, h].transpose(1, 2), out=s[:, h])
        return s

    def result(self) -> torch.Tensor:
        return self.acc / self.l


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
    block_pages: int,
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
) -> torch.Tensor:
    """Causal attention of the step's new tokens over each sequence's history and themselves."""
    pools = (pool, image_pool, raised_pool)
    if len(batch.groups) == 1:
        return _attend_group(layer, batch.groups[0], q, k, v, scale, pools, ring, sinks, block_pages)
    out = torch.empty(q.shape, dtype=COMPUTE, device=q.device)
    for group in batch.groups:
        assert group.rows is not None
        group.put(out, _attend_group(layer, group, q, k, v, scale, pools, ring, sinks, block_pages))
    return out


def _attend_group(
    layer: int,
    g: GroupPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pools: tuple[ColdPool, ColdPool | None, ColdPool | None],
    ring: HotRing,
    sinks: SinkStore | None,
    block_pages: int,
) -> torch.Tensor:
    """``[B*T, Hq, D]`` outputs of one group, in compute dtype."""
    B, T = g.batch, g.tokens
    _, hq, d = q.shape
    hkv = k.shape[1]
    # The history after the cold pages: sinks (if this group has any), ring rows, new tokens.
    ring_rows = g.ring_rows.view(-1)
    tails_k = [ring.k[layer].index_select(0, ring_rows).view(B, -1, hkv, d)]
    tails_v = [ring.v[layer].index_select(0, ring_rows).view(B, -1, hkv, d)]
    tails_k.append(g.take(k).reshape(B, T, hkv, d))
    tails_v.append(g.take(v).reshape(B, T, hkv, d))
    sink_k = sink_v = None
    if sinks is not None and g.sink_table is not None:
        sink_k = sinks.k[layer].index_select(0, g.sink_table)
        sink_v = sinks.v[layer].index_select(0, g.sink_table)
    group = hq // hkv
    # GQA as rows: the ``group`` query heads of a KV head become ``group * T`` query rows of that
    # head, so each KV head's keys are read once (no expansion to hq heads).
    qs = g.take(q).to(COMPUTE)
    qg = qs.view(B, T, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(B, hkv, group * T, d)
    segments = _cold_segments(g, pools)
    if sum(table.shape[1] for _, table, _ in segments) <= block_pages:
        parts_k, parts_v = [], []
        for pool, table, _ in segments:
            if table.shape[1]:
                kc, vc = pool.read(layer, table, COMPUTE)
                parts_k.append(kc.view(B, -1, hkv, d))
                parts_v.append(vc.view(B, -1, hkv, d))
        if sink_k is not None and sink_v is not None:
            parts_k.append(sink_k)
            parts_v.append(sink_v)
        keys = _concat([*parts_k, *tails_k]).transpose(1, 2)
        values = _concat([*parts_v, *tails_v]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qg, keys, values, attn_mask=g.mask(group), scale=scale)
    else:
        o = _attend_blocks(
            layer, g, qg * scale, segments, block_pages, sink_k, sink_v, tails_k, tails_v, group
        )
    o = o.view(B, hkv, group, T, d).permute(0, 3, 1, 2, 4)
    return o.reshape(B * T, hq, d)


Segment = tuple[ColdPool, torch.Tensor, str]


def _cold_segments(g: GroupPlan, pools: tuple[ColdPool, ColdPool | None, ColdPool | None]) -> list[Segment]:
    """(pool, page table, name of its bias) of the text pages, then of the image pages and of the raised
    pages (when the group has such a table)."""
    pool, image_pool, raised_pool = pools
    segments: list[Segment] = [(pool, g.page_table, "cold_bias")]
    for table, extra, name in ((g.image_table, image_pool, "image"), (g.raised_table, raised_pool, "raised")):
        if table is not None:
            if extra is None:
                raise ValueError(f"the step's plan has {name} pages but no {name} pool was given")
            segments.append((extra, table, f"{name}_bias"))
    return segments


def _attend_blocks(
    layer: int,
    g: GroupPlan,
    qg: torch.Tensor,
    segments: list[Segment],
    block_pages: int,
    sink_k: torch.Tensor | None,
    sink_v: torch.Tensor | None,
    tails_k: list[torch.Tensor],
    tails_v: list[torch.Tensor],
    group: int,
) -> torch.Tensor:
    """Online softmax over blocks of cold pages (text, image, raised), the sink page, then ring + new:
    ``[B, Hkv, rows, D]``."""
    B, hkv, _, d = qg.shape
    state = OnlineSoftmax(qg)
    P = g.page_size
    for pool, pages, bias_name in segments:
        bias = getattr(g, bias_name)
        for start in range(0, pages.shape[1], block_pages):
            table = pages[:, start : start + block_pages]
            kb, vb = pool.read(layer, table, COMPUTE)
            n = table.shape[1] * P
            state.update(
                kb.reshape(B, n, hkv, d), vb.reshape(B, n, hkv, d), bias[..., start * P : start * P + n]
            )
    if sink_k is not None and sink_v is not None:
        state.update(_concat([sink_k]), _concat([sink_v]), g.sink_bias)
    state.update(_concat(tails_k), _concat(tails_v), g.tail_bias(group))
    return state.result()


def _concat(parts: list[torch.Tensor]) -> torch.Tensor:
    """Key segments ``[B, S_i, Hkv, D]`` joined along S in the compute dtype (``cat`` converts
    BF16 ring rows as it copies them: no separate float32 copy)."""
    if all(p.dtype != COMPUTE for p in parts):
        parts = [parts[0].to(COMPUTE), *parts[1:]]
    return torch.cat(parts, dim=1)


def store(
    layer: int,
    batch: StepBatch,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    clips: tuple[torch.Tensor | None, torch.Tensor | None],
    image_pool: ColdPool | None = None,
    raised_pool: ColdPool | None = None,
) -> WriteCounts:
    """Quantize the pages completed in this step (once) and put the new tokens in the ring.

    Pages are gathered before the ring is written: a long prefill chunk writes ring rows that
    alias the positions an incomplete page still has to read.
    """
    w = batch.write
    counts = WriteCounts()
    n = w.page_ids.numel()
    if n:
        P, (_, _, hkv, d) = pool.page_size, ring.k.shape
        pages_kv = []
        for buf, new in zip(layer_kv(ring, layer), (k, v), strict=True):
            pages = torch.empty((n * P, hkv, d), dtype=COMPUTE, device=k.device)
            pages.index_copy_(0, w.from_ring[0], buf.index_select(0, w.from_ring[1]).to(COMPUTE))
            pages.index_copy_(0, w.from_new[0], new.index_select(0, w.from_new[1]).to(COMPUTE))
            pages_kv.append(pages.view(n, P, hkv, d))
        for which, page_ids, target in w.pool_writes(pool, image_pool, raised_pool):
            counts = counts.merge(_write_pages(layer, target, page_ids, pages_kv, which, clips))
        if sinks is not None and w.sink_pages.numel():
            sinks.k[layer, w.sink_slots] = pages_kv[0][w.sink_pages].to(sinks.k.dtype)
            sinks.v[layer, w.sink_slots] = pages_kv[1][w.sink_pages].to(sinks.v.dtype)
    write_ring(layer, batch, k, v, ring)
    return counts


def _write_pages(
    layer: int,
    pool: ColdPool,
    page_ids: torch.Tensor,
    pages_kv: list[torch.Tensor],
    which: torch.Tensor | None,
    clips: tuple[torch.Tensor | None, torch.Tensor | None],
) -> WriteCounts:
    """Write the completed pages ``which`` (indices into the step's pages, None: all) to ``page_ids``
    of ``pool``."""
    if not page_ids.numel():
        return WriteCounts()
    k_pages, v_pages = pages_kv if which is None else (p.index_select(0, which) for p in pages_kv)
    return pool.write(layer, page_ids, k_pages, v_pages, *clips)


_LAYER_VIEWS: WeakKeyDictionary[Any, tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]] = (
    WeakKeyDictionary()
)


def layer_kv(store: HotRing | SinkStore, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(store.k[layer], store.v[layer])``: views made once per store (while its ``k`` is the same
    tensor), as a decode step's per-layer calls would otherwise make them again in every layer."""
    got = _LAYER_VIEWS.get(store)
    if got is None or got[0] is not store.k:
        got = _LAYER_VIEWS[store] = (store.k, list(zip(store.k.unbind(0), store.v.unbind(0), strict=True)))
    return got[1][layer]


def write_ring(layer: int, batch: StepBatch, k: torch.Tensor, v: torch.Tensor, ring: HotRing) -> None:
    """Put the step's new tokens that stay recent into their ring rows (after completed pages read
    the ring). When every new token stays (decode), ``k``/``v`` are copied without a gather."""
    w = batch.write
    every_row = w.ring_src.numel() == k.shape[0]  # ring_src ascends: then it is every row (decode)
    for buf, new in zip(layer_kv(ring, layer), (k, v), strict=True):
        buf.index_copy_(0, w.ring_dst, (new if every_row else new.index_select(0, w.ring_src)).to(buf.dtype))
