"""Shared helpers of the radix tests: dense reference attention and deterministic synthetic K/V."""

from __future__ import annotations

import math
import random
from collections.abc import Hashable

import torch

from kvstrata.quant import get_codec
from kvstrata.radix import CacheConfig, StratifiedKVCache


def dense_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, scale: float
) -> torch.Tensor:
    """Plain softmax attention in float64: query i (position ``start + i``) sees keys ``0..start+i``.

    q ``[T, Hq, D]``, k/v ``[S, Hkv, D]``; GQA maps query head h to KV head ``h // (Hq // Hkv)``.
    """
    group = q.shape[1] // k.shape[1]
    kk = k.double().repeat_interleave(group, dim=1)
    vv = v.double().repeat_interleave(group, dim=1)
    s = torch.einsum("thd,shd->hts", q.double(), kk) * scale
    pos_q = torch.arange(q.shape[0]).view(-1, 1) + start
    s = s.masked_fill(torch.arange(k.shape[0]).view(1, -1) > pos_q, float("-inf"))
    return torch.einsum("hts,shd->thd", s.softmax(dim=-1), vv)


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


class TokenKV:
    """K/V/Q of a position as a function of (namespace, tokens up to and including it), like a model:
    equal prefixes give equal K/V, so pages shared through the tree must read back exactly."""

    def __init__(self, kv_heads: int, q_heads: int, head_dim: int) -> None:
        self.shape_kv = (kv_heads, head_dim)
        self.shape_q = (q_heads, head_dim)
        self._memo: dict[tuple[Hashable, tuple[int, ...]], tuple[torch.Tensor, ...]] = {}

    def at(self, ns: Hashable, prefix: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = (ns, prefix)
        got = self._memo.get(key)
        if got is None:
            rng = random.Random(hash(key))
            n_kv, n_q = math.prod(self.shape_kv), math.prod(self.shape_q)
            vals = torch.tensor([rng.gauss(0.0, 1.0) for _ in range(2 * n_kv + n_q)])
            got = (
                vals[n_kv * 2 :].view(self.shape_q),
                vals[:n_kv].view(self.shape_kv),
                vals[n_kv : 2 * n_kv].view(self.shape_kv),
            )
            self._memo[key] = got
        return got  # type: ignore[return-value]

    def span(self, ns: Hashable, tokens: list[int], start: int, stop: int) -> tuple[torch.Tensor, ...]:
        """(q, k, v) of positions ``[start, stop)``, each ``[stop - start, heads, D]``."""
        rows = [self.at(ns, tuple(tokens[: p + 1])) for p in range(start, stop)]
        return tuple(torch.stack([r[i] for r in rows]) for i in range(3))


def small_cache(**overrides: object) -> StratifiedKVCache:
    params: dict[str, object] = dict(
        num_layers=2,
        kv_heads=2,
        head_dim=8,
        page_size=4,
        recent_window=8,
        layer_codecs=["fp32", "fp32"],
        ring_dtype=torch.float32,
        num_pages=32,
        max_running=4,
    )
    params.update(overrides)
    return StratifiedKVCache(CacheConfig(**params))  # type: ignore[arg-type]


def run_step(
    cache: StratifiedKVCache,
    seqs: list,
    n_new: list[int],
    data: TokenKV,
    scale: float,
) -> list[torch.Tensor]:
    """One step through every layer with ``data``'s q/k/v; returns each layer's output."""
    batch = cache.begin_step(seqs, n_new)
    parts = [
        data.span(s.extra_key, s.token_ids, s.length, s.length + n) for s, n in zip(seqs, n_new, strict=True)
    ]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    outs = [cache.attention(layer, batch, q, k, v, scale) for layer in range(cache.cfg.num_layers)]
    cache.end_step(batch)
    return outs


def roundtrip(codec: str, x: torch.Tensor, granularity: str) -> torch.Tensor:
    """One page ``[P, H, D]`` stored in ``codec`` and read back."""
    c = get_codec(codec)
    q = c.quantize(x[None], granularity=granularity)
    return c.dequantize_parts(q.parts, granularity, x.shape[-1], torch.float32)[0]
