"""Reference attention over the strata: cold pages (dequantized block by block), sinks, ring, new.

One online-softmax pass per group of equal-length steps: the running max ``m``, denominator ``l``
and numerator ``acc`` are rescaled as each segment arrives, so the history is never dequantized as
a whole; at most ``block_pages`` pages per sequence are decoded at a time. Queries are laid out
``[B, kv_heads, group * T, D]`` (GQA: the ``group`` query heads of a KV head share its keys), so
each segment is two batched matmuls for all heads and sequences of the group.
"""

from __future__ import annotations

import torch

from kvstrata.radix.plan import GroupPlan, StepBatch
from kvstrata.radix.pool import ColdPool, WriteCounts
from kvstrata.radix.ring import HotRing
from kvstrata.radix.sinks import SinkStore

COMPUTE = torch.float32


class OnlineSoftmax:
    """softmax(q k^T + bias) v accumulated over key segments ``[B, S, Hkv, D]``."""

    def __init__(self, q: torch.Tensor, padded: bool) -> None:
        self.q = q  # [B, Hkv, rows, D], already scaled
        self.padded = padded  # some keys are padding that reads other sequences' rows
        shape = (*q.shape[:-1], 1)
        self.m = torch.full(shape, float("-inf"), dtype=COMPUTE, device=q.device)
        self.l = torch.zeros(shape, dtype=COMPUTE, device=q.device)
        self.acc = torch.zeros_like(q)

    def update(self, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> None:
        s = self._scores(k)
        s += bias
        if self.padded:
            # Padded slots read other sequences' rows (masked by -inf above), and raw tiers keep NaN/Inf
            # as written: a non-finite score never enters the softmax and a non-finite value never
            # meets a zero weight (0 * NaN = NaN), so one request's bad K/V cannot reach its neighbours.
            s.nan_to_num_(nan=float("-inf"), posinf=float("-inf"))
            v = torch.nan_to_num(v, nan=0.0, posinf=0.0, neginf=0.0)
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
) -> torch.Tensor:
    """Causal attention of the step's new tokens over each sequence's history and themselves."""
    out = torch.empty(q.shape, dtype=COMPUTE, device=q.device)
    for group in batch.groups:
        out[group.rows] = _attend_group(layer, group, q, k, v, scale, pool, ring, sinks, block_pages)
    return out


def _attend_group(
    layer: int,
    g: GroupPlan,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    block_pages: int,
) -> torch.Tensor:
    B, T = g.batch, g.tokens
    _, hq, d = q.shape
    hkv = k.shape[1]
    group = hq // hkv
    qg = q[g.rows].to(COMPUTE).view(B, T, hkv, group, d).permute(0, 2, 3, 1, 4).reshape(B, hkv, group * T, d)
    state = OnlineSoftmax(qg * scale, padded=B > 1)  # one sequence alone has no padding
    P = pool.page_size
    for start in range(0, g.page_table.shape[1], block_pages):
        table = g.page_table[:, start : start + block_pages]
        kb, vb = pool.read(layer, table, COMPUTE)
        n = table.shape[1] * P
        state.update(
            kb.reshape(B, n, hkv, d), vb.reshape(B, n, hkv, d), g.cold_bias[..., start * P : start * P + n]
        )
    if sinks is not None and g.sink_table is not None and g.sink_bias is not None:
        ks = sinks.k[layer, g.sink_table].to(COMPUTE)
        vs = sinks.v[layer, g.sink_table].to(COMPUTE)
        state.update(ks, vs, g.sink_bias)
    k_new = k[g.rows].to(COMPUTE).view(B, T, hkv, d)
    v_new = v[g.rows].to(COMPUTE).view(B, T, hkv, d)
    k_tail = torch.cat([ring.k[layer][g.ring_rows].to(COMPUTE), k_new], dim=1)
    v_tail = torch.cat([ring.v[layer][g.ring_rows].to(COMPUTE), v_new], dim=1)
    state.update(k_tail, v_tail, g.tail_bias(group))
    o = state.result().view(B, hkv, group, T, d).permute(0, 3, 1, 2, 4)
    return o.reshape(B * T, hq, d)


def store(
    layer: int,
    batch: StepBatch,
    k: torch.Tensor,
    v: torch.Tensor,
    pool: ColdPool,
    ring: HotRing,
    sinks: SinkStore | None,
    clips: tuple[torch.Tensor | None, torch.Tensor | None],
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
        for buf, new in ((ring.k[layer], k), (ring.v[layer], v)):
            pages = torch.empty((n * P, hkv, d), dtype=COMPUTE, device=k.device)
            pages[w.from_ring[0]] = buf[w.from_ring[1]].to(COMPUTE)
            pages[w.from_new[0]] = new[w.from_new[1]].to(COMPUTE)
            pages_kv.append(pages.view(n, P, hkv, d))
        counts = pool.write(layer, w.page_ids, pages_kv[0], pages_kv[1], *clips)
        if sinks is not None and w.sink_pages.numel():
            sinks.k[layer, w.sink_slots] = pages_kv[0][w.sink_pages].to(sinks.k.dtype)
            sinks.v[layer, w.sink_slots] = pages_kv[1][w.sink_pages].to(sinks.v.dtype)
    ring.k[layer].index_copy_(0, w.ring_dst, k[w.ring_src].to(ring.k.dtype))
    ring.v[layer].index_copy_(0, w.ring_dst, v[w.ring_src].to(ring.v.dtype))
    return counts
