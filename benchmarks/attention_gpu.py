"""Decode and extend attention over the strata on one GPU: Triton kernels vs torch SDPA on BF16.

    python benchmarks/attention_gpu.py [--geometry 8b,default] [--batch 1,16,64,256] [--context 4096,32768]

For each geometry (8B layer: 32 query / 8 KV heads, head_dim 128; the default model: 9 / 3, 64), batch
and context, and each history codec: one decode step (one query token per sequence) over cold pages
(context - window - 1 tokens) + a 128-token BF16 ring + the new token, timed as the median device
time of CUDA-graph replays with an L2 flush before each call (`bench`). Printed: milliseconds, the
bytes the kernel must read (codes + scales of the cold pages, ring rows, q/k/v/out), achieved TB/s,
the speedup over `scaled_dot_product_attention` on contiguous BF16 K/V of the same context measured
in the same run (GQA, one query token), and its bandwidth as a share of SDPA's. The old torch backend
(dequantize, then attend) is timed on the same data for fp8_e4m3 where it fits (plain launches: it
syncs with the host). Extend: a 2,048-token chunk over 30,720 cached tokens (B=1, 8B layer) against
SDPA (flash) on BF16 K/V without a mask (the causal chunk is ~3% less work). ``--peers flashinfer``:
FlashInfer's paged decode (what SGLang's flashinfer backend runs) on BF16 and FP8 KV of each decode
case, as rows of their own (`flashinfer_peer`).
Writes a JSON of every row to --out.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
from functools import partial

import flashinfer_peer
import torch
import torch.nn.functional as F
import triton

from kvstrata.radix import CacheConfig, StratifiedKVCache
from kvstrata.radix import attention as torch_attention
from kvstrata.radix.kernels import attend as kernels
from kvstrata.radix.plan import GroupPlan

GEOMETRIES = {"8b": (32, 8, 128), "default": (9, 3, 64)}
CODECS = ["bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "fp4_e2m1"]
PEERS = ("flashinfer",)
P, WINDOW = 16, 128


_FLUSH: list[torch.Tensor] = []


def bench(fn, graph: bool = True) -> float:
    """Median milliseconds of ``fn`` on the GPU. ``graph``: replays of a CUDA graph of calls, each after
    an L2 flush (a 256 MB write), minus the flushes' own replays: the device time of a step without
    the host's launch overhead (which bounds a B=1 step timed by plain launches) and without data
    left in L2 by the call before. Otherwise `triton.testing.do_bench` (plain launches, L2 flushed)."""
    if not graph:
        return triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
    if not _FLUSH:
        _FLUSH.append(torch.empty(256 << 20, dtype=torch.int8, device="cuda"))
    flush = _FLUSH[0].zero_

    def step():
        flush()
        fn()

    both = triton.testing.do_bench_cudagraph(step, rep=20, return_mode="median")
    return both - triton.testing.do_bench_cudagraph(flush, rep=20, return_mode="median")


def build(
    codec: str,
    batch: int,
    context: int,
    hq: int,
    hkv: int,
    d: int,
    tokens: int = 1,
    device: str = "cuda",
    fill: bool = True,
):
    """A one-layer cache holding ``batch`` sequences of ``context - tokens`` cached tokens (cold pages
    + ring), the step's plan, and q/k/v of the new tokens. ``fill``: random history in the pool and
    ring (off: the shapes only, e.g. to compile the step's kernels)."""
    cold = (context - tokens - (WINDOW - 1)) // P
    ring_len = context - tokens - cold * P
    cache = StratifiedKVCache(
        CacheConfig(
            num_layers=1,
            kv_heads=hkv,
            head_dim=d,
            page_size=P,
            recent_window=ring_len // P * P + P,
            layer_codecs=[codec],
            ring_dtype=torch.bfloat16,
            num_pages=batch * cold,
            max_running=batch,
            device=device,
        )
    )
    if fill:
        chunk = max(1, (1 << 27) // (P * hkv * d))
        for start in range(0, batch * cold, chunk):
            ids = torch.arange(start, min(start + chunk, batch * cold), device=device)
            kv = torch.randn(2, ids.numel(), P, hkv, d, device=device, dtype=torch.bfloat16)
            cache.pool.write(0, ids, kv[0], kv[1])
        cache.ring.k.normal_()
        cache.ring.v.normal_()
    cap = cache.ring.capacity
    ring_rows = (
        torch.arange(batch, device=device).view(-1, 1) * cap + torch.arange(ring_len, device=device)
    ).long()
    plan = GroupPlan(
        None,
        batch,
        tokens,
        torch.arange(batch * cold, device=device).view(batch, cold),
        [cold] * batch,
        None,
        [False] * batch,
        ring_rows,
        [ring_len] * batch,
        P,
    )
    q = torch.randn(batch * tokens, hq, d, device=device, dtype=torch.bfloat16)
    k = torch.randn(batch * tokens, hkv, d, device=device, dtype=torch.bfloat16)
    v = torch.randn(batch * tokens, hkv, d, device=device, dtype=torch.bfloat16)
    moved = (
        batch * cold * cache.pool.page_bytes
        + 2 * batch * ring_len * hkv * d * 2
        + (2 * q.numel() + k.numel() + v.numel()) * 2
    )
    return cache, plan, q, k, v, moved


def sdpa_case(batch: int, context: int, hq: int, hkv: int, d: int, tokens: int = 1):
    q = torch.randn(batch, hq, tokens, d, device="cuda", dtype=torch.bfloat16)
    kv = torch.randn(2, batch, hkv, context, d, device="cuda", dtype=torch.bfloat16)
    moved = kv.numel() * 2 + 2 * q.numel() * 2
    return (lambda: F.scaled_dot_product_attention(q, kv[0], kv[1], enable_gqa=True)), moved


def codec_rows(geometry: str, batch: int, context: int, codec: str, old_torch: bool) -> list[dict]:
    """The Triton kernel (and optionally the old torch backend) on one codec's strata."""
    hq, hkv, d = GEOMETRIES[geometry]
    cache, plan, q, k, v, moved = build(codec, batch, context, hq, hkv, d)
    args = (0, plan, q, k, v, 1 / math.sqrt(d), cache.pool, cache.ring, None)
    row = dict(geometry=geometry, batch=batch, context=context, bytes=moved)
    rows = [dict(row, codec=codec, ms=bench(partial(kernels.attend_group, *args)))]
    if old_torch:
        torch_args = (*args[:6], (cache.pool, None, None), *args[7:], cache.cfg.block_pages)
        ms = bench(partial(torch_attention._attend_group, *torch_args), graph=False)
        rows.append(dict(row, codec=f"{codec} torch", ms=ms))
    return rows


def decode_rows(
    geometry: str,
    batch: int,
    context: int,
    old_torch: bool,
    codecs: list[str] = CODECS,
    peers: tuple[str, ...] = (),
) -> list[dict]:
    hq, hkv, d = GEOMETRIES[geometry]
    fn, moved = sdpa_case(batch, context, hq, hkv, d)
    base_ms = bench(fn)
    base_tbs = moved / base_ms / 1e9
    rows = [dict(geometry=geometry, batch=batch, context=context, codec="SDPA bf16", ms=base_ms, bytes=moved)]
    del fn
    torch.cuda.empty_cache()
    for codec in codecs:
        rows += codec_rows(geometry, batch, context, codec, old_torch and codec == "fp8_e4m3")
        torch.cuda.empty_cache()
    if "flashinfer" in peers:
        rows += flashinfer_peer.rows(bench, geometry, batch, context, hq, hkv, d)
    for r in rows:
        r["tbs"] = r["bytes"] / r["ms"] / 1e9
        r["vs_sdpa"] = base_ms / r["ms"]
        r["bw_share"] = r["tbs"] / base_tbs
    return rows


def extend_rows(codecs: list[str]) -> list[dict]:
    hq, hkv, d = GEOMETRIES["8b"]
    chunk, cached = 2048, 30720
    fn, moved = sdpa_case(1, cached + chunk, hq, hkv, d, tokens=chunk)
    base_ms = bench(fn)
    rows = [
        dict(
            geometry="8b", batch=1, context=cached + chunk, codec="extend SDPA bf16", ms=base_ms, bytes=moved
        )
    ]
    for codec in codecs:
        cache, plan, q, k, v, moved = build(codec, 1, cached + chunk, hq, hkv, d, tokens=chunk)
        args = (0, plan, q, k, v, 1 / math.sqrt(d), cache.pool, cache.ring, None)
        ms = bench(partial(kernels.attend_group, *args))
        rows.append(
            dict(geometry="8b", batch=1, context=cached + chunk, codec=f"extend {codec}", ms=ms, bytes=moved)
        )
        cache = plan = q = k = v = None
        torch.cuda.empty_cache()
    for r in rows:
        r["tbs"] = r["bytes"] / r["ms"] / 1e9
        r["vs_sdpa"] = base_ms / r["ms"]
        r["bw_share"] = float("nan")
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--geometry", default="8b,default")
    ap.add_argument("--batch", default="1,16,64,256")
    ap.add_argument("--context", default="4096,32768")
    ap.add_argument("--no-extend", action="store_true")
    ap.add_argument("--codecs", default=",".join(CODECS), help="the history codecs timed for decode")
    ap.add_argument("--out", default="attention_gpu.json")
    ap.add_argument(
        "--peers",
        default="",
        help="peer kernels timed on the same cases: 'flashinfer' (its paged decode, BF16 and FP8 KV)",
    )
    args = ap.parse_args()
    peers = tuple(p for p in args.peers.split(",") if p)
    if set(peers) - set(PEERS):
        ap.error(f"unknown peer(s) {sorted(set(peers) - set(PEERS))}; known: {', '.join(PEERS)}")
    if "flashinfer" in peers and importlib.util.find_spec("flashinfer") is None:
        ap.error(
            "--peers flashinfer: flashinfer is not importable (on the GPU machine, put the SGLang "
            "payload's site on PYTHONPATH)"
        )
    name = torch.cuda.get_device_name()
    print(f"# {name}, torch {torch.__version__}, triton {triton.__version__}", flush=True)
    rows: list[dict] = []
    for geometry in args.geometry.split(","):
        for context in map(int, args.context.split(",")):
            for batch in map(int, args.batch.split(",")):
                old_torch = batch * context <= 64 * 32768
                got = decode_rows(geometry, batch, context, old_torch, args.codecs.split(","), peers)
                rows += got
                for r in got:
                    print(json.dumps(r), flush=True)
    if not args.no_extend:
        rows += extend_rows(["bf16", "fp8_e4m3", "int4"])
    with open(args.out, "w") as f:
        json.dump(
            dict(device=name, torch=torch.__version__, triton=triton.__version__, rows=rows), f, indent=1
        )
    print(f"\n{name}, torch {torch.__version__}, triton {triton.__version__}")
    print("| geometry | B | context | codec | ms | MB moved | TB/s | vs SDPA bf16 | BW share of SDPA |")
    print("|---|---:|---:|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['geometry']} | {r['batch']} | {r['context']} | {r['codec']} | {r['ms']:.3f} | "
            f"{r['bytes'] / 1e6:.0f} | {r['tbs']:.2f} | {r['vs_sdpa']:.2f}x | {r['bw_share']:.0%} |"
        )


if __name__ == "__main__":
    main()
