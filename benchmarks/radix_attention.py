"""Decode/prefill attention through the stratified cache vs plain SDPA over dense fp32 K/V.

Geometry of the embedded model (SmolLM2-135M: 30 layers, 9 query / 3 KV heads, head_dim 64);
a batch of sequences with equal histories; one step = attention of all layers, as the engine runs.
Prints milliseconds per step for each history codec and the ratio to the SDPA baseline measured in
the same run. ``python benchmarks/radix_attention.py --batch 8 --history 1000``
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from kvstrata.engine.malloc import tune_malloc
from kvstrata.radix import CacheConfig, StratifiedKVCache

LAYERS, HQ, HKV, D = 30, 9, 3, 64


def build(codec: str, batch: int, history: int, window: int) -> tuple[StratifiedKVCache, list]:
    cfg = CacheConfig(
        num_layers=LAYERS,
        kv_heads=HKV,
        head_dim=D,
        page_size=16,
        recent_window=window,
        layer_codecs=[codec] * LAYERS,
        num_pages=batch * (history // 16 + 40),
        max_running=batch,
    )
    cache = StratifiedKVCache(cfg)
    seqs = [cache.admit(list(range(i * 100_000, i * 100_000 + history + 512))) for i in range(batch)]
    g = torch.Generator().manual_seed(0)
    for seq in seqs:  # prefill one sequence at a time, in chunks of 512
        done = 0
        while done < history:
            n = min(512, history - done)
            step = cache.begin_step([seq], [n])
            for layer in range(LAYERS):
                k, v = torch.randn(n, HKV, D, generator=g), torch.randn(n, HKV, D, generator=g)
                cache.attention(layer, step, torch.randn(n, HQ, D, generator=g), k, v, 1 / math.sqrt(D))
            cache.end_step(step)
            done += n
    return cache, seqs


def time_steps(fn, repeats: int) -> float:
    fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats * 1e3


def cache_step(cache: StratifiedKVCache, seqs: list, n: int) -> float:
    q = torch.randn(len(seqs) * n, HQ, D)
    k = torch.randn(len(seqs) * n, HKV, D)
    v = torch.randn(len(seqs) * n, HKV, D)
    step = cache.begin_step(seqs, [n] * len(seqs))
    start = time.perf_counter()
    for layer in range(LAYERS):
        cache.attention(layer, step, q, k, v, 1 / math.sqrt(D))
    elapsed = time.perf_counter() - start
    cache.cancel_step(step)  # keep the history length fixed between repeats
    return elapsed * 1e3


def sdpa_step(batch: int, history: int, n: int) -> float:
    q = torch.randn(batch, HQ, n, D)
    k = torch.randn(batch, HKV, history + n, D)
    v = torch.randn(batch, HKV, history + n, D)
    mask = torch.ones(n, history + n, dtype=torch.bool).tril(history)
    start = time.perf_counter()
    for _ in range(LAYERS):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--history", type=int, default=1000)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--new", type=int, default=1, help="new tokens per sequence (1 = decode)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--codecs", default="bf16,fp8_e4m3,int4,fp4_e2m1")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1: stable on a shared CPU)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    malloc = tune_malloc()  # as the engine does on CPU: without it temporaries page-fault every step
    base = min(sdpa_step(args.batch, args.history, args.new) for _ in range(args.repeats))
    print(
        f"torch {torch.__version__}, threads {torch.get_num_threads()}; batch {args.batch} x history "
        f"{args.history} + {args.new} new, {LAYERS} layers, {HQ}/{HKV} heads x {D}; malloc tuning {malloc}"
    )
    print(f"{'baseline sdpa (dense fp32)':28s} {base:8.1f} ms/step")
    for codec in args.codecs.split(","):
        cache, seqs = build(codec, args.batch, args.history, args.window)
        ms = min(cache_step(cache, seqs, args.new) for _ in range(args.repeats))
        print(f"{'cache ' + codec:28s} {ms:8.1f} ms/step  ({ms / base:.2f}x sdpa)")


if __name__ == "__main__":
    main()
