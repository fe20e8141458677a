"""Helpers of the kernel tests: where they run, filling a cache, and the float64 reference read of
a step's plan (what the cache stores, dequantized by the codec, attended densely).

Without CUDA the Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set before
`kvstrata.radix.kernels` is first imported, which this module does at collection time.
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from radix_helpers import dense_attention  # noqa: E402

from kvstrata.radix import StratifiedKVCache  # noqa: E402

DEVICES = ["cuda"] if torch.cuda.is_available() else ["cpu"]


def fill(cache: StratifiedKVCache, lengths: list[int], g: torch.Generator, hq: int, scale: float) -> list:
    """Admit one sequence per length and prefill it through the torch path in one step."""
    seqs = [cache.admit(list(range(1000 * i, 1000 * i + n + 64))) for i, n in enumerate(lengths)]
    batch = cache.begin_step(seqs, lengths)
    T, H, D = sum(lengths), cache.cfg.kv_heads, cache.cfg.head_dim
    dtype, dev = cache.cfg.ring_dtype, cache.device
    for layer in range(cache.cfg.num_layers):
        q, k, v = (torch.randn(T, n, D, generator=g).to(dev, dtype) for n in (hq, H, H))
        cache.attention(layer, batch, q, k, v, scale)
    cache.end_step(batch)
    return seqs


def kernel_attend(cache, batch, q, k, v, scale, splits=None, layer: int = 0) -> torch.Tensor:
    from kvstrata.radix.kernels import attend

    if splits is None:
        return attend.attend(
            layer, batch, q, k, v, scale, cache.pool, cache.ring, cache.sinks, cache.image_pool,
            raised_pool=cache.raised_pool,
        )  # fmt: skip
    out = torch.empty_like(q)
    for grp in batch.groups:
        rows = torch.arange(q.shape[0], device=q.device) if grp.rows is None else grp.rows
        got = attend.attend_group(
            layer,
            grp,
            q[rows],
            k[rows],
            v[rows],
            scale,
            cache.pool,
            cache.ring,
            cache.sinks,
            splits,
            cache.image_pool,
            cache.raised_pool,
        )
        out[rows] = got
    return out


def reference_attend(cache, batch, q, k, v, scale, layer: int = 0) -> torch.Tensor:
    """float64 ``[T, Hq, D]`` on CPU: per sequence, dense causal attention over its dequantized cold
    pages (text pages from the pool, image pages from the image pool), its sink page, its ring rows and
    the new tokens, read through the step's plan."""
    out = torch.empty(q.shape, dtype=torch.float64)
    P = cache.page_size
    for grp in batch.groups:
        T = grp.tokens
        rows = torch.arange(q.shape[0]) if grp.rows is None else grp.rows.cpu()
        for b in range(grp.batch):
            keys, values = [], []
            cold = [(cache.pool, grp.page_table, grp.cold_pages[b])]
            if grp.image_table is not None:
                cold.append((cache.image_pool, grp.image_table, grp.image_pages[b]))
            if grp.raised_table is not None:
                cold.append((cache.raised_pool, grp.raised_table, grp.raised_pages[b]))
            for pool, table, n_cold in cold:
                if n_cold:
                    kc, vc = pool.read(layer, table[b, :n_cold], torch.float64)
                    keys.append(kc.reshape(n_cold * P, *kc.shape[-2:]).cpu())
                    values.append(vc.reshape(n_cold * P, *vc.shape[-2:]).cpu())
            if grp.sink_table is not None and grp.sink_valid[b]:
                keys.append(cache.sinks.k[layer, grp.sink_table[b]].cpu().double())
                values.append(cache.sinks.v[layer, grp.sink_table[b]].cpu().double())
            ring_rows = grp.ring_rows[b, : grp.ring_len[b]]
            keys.append(cache.ring.k[layer, ring_rows].cpu().double())
            values.append(cache.ring.v[layer, ring_rows].cpu().double())
            mine = rows[b * T : (b + 1) * T]
            history = sum(x.shape[0] for x in keys)
            keys.append(k[mine.to(k.device)].cpu().double())
            values.append(v[mine.to(v.device)].cpu().double())
            qb = q[mine.to(q.device)].cpu().double()
            out[mine] = dense_attention(qb, torch.cat(keys), torch.cat(values), history, scale)
    return out
