"""Host time of a decode step's Triton attention: the Python around the kernel launches, per layer.

The engine runs a decode step's attention eagerly between CUDA-graph pieces, one call per layer
(`kvstrata/engine/cuda_graph.py`); at B=256 the engine thread's launch time was on the critical path
(docs/engine.md, "Step timeline"). This script builds the step on CPU with the Triton kernels' launches
replaced by no-ops (`JITFunction.run`), so what it times is the Python and the torch ops around them:
the layer's `StratifiedKVCache.attention(kernels=True)` call (attention launch arguments, the page
flush, the ring write, the encoder counts).

Geometry of Llama-3-8B (32 query / 8 KV heads, head_dim 128) with fewer layers (the per-layer work does
not depend on the layer count), FP8 history with the shipped defaults (128-token window, sinks), B
sequences of about ``--context`` tokens whose lengths are staggered so that B/16 of them complete a page
each step, as in steady serving. Prints per-layer microseconds of the current code and of the baseline
in the same run: ``--baseline`` the per-layer path without the per-step launch plan (the code before
it). ``python benchmarks/attention_host.py --batch 256 --context 2048 --layers 4 --profile``
"""

from __future__ import annotations

import argparse
import cProfile
import math
import pstats
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch

from kvstrata.engine.malloc import tune_malloc
from kvstrata.radix import CacheConfig, StratifiedKVCache
from kvstrata.radix.kernels import attend, decode, decode4, page_quantize

HQ, HKV, D = 32, 8, 128
PAGE = 16
KERNELS = (
    decode._decode_kernel,
    decode4._decode4_kernel,
    attend._attend_kernel,
    attend._merge_kernel,
    page_quantize._page_quantize_kernel,
)


@contextmanager
def no_launches():
    """The Triton kernels' launches do nothing (their Python launchers are not timed)."""
    for kernel in KERNELS:
        kernel.run = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for kernel in KERNELS:
            del kernel.run


def build(batch: int, context: int, layers: int, codec: str, device: str) -> tuple[StratifiedKVCache, list]:
    """A cache holding ``batch`` sequences of ``context + (i % PAGE)`` tokens: lengths advanced
    through the plan only (the pages' contents are never read with the launches off)."""
    cfg = CacheConfig(
        num_layers=layers,
        kv_heads=HKV,
        head_dim=D,
        page_size=PAGE,
        recent_window=128,
        layer_codecs=[codec] * layers,
        num_pages=batch * (context // PAGE + 4),
        max_running=batch,
        sinks=True,
        device=device,
    )
    cache = StratifiedKVCache(cfg)
    lengths = [context + i % PAGE for i in range(batch)]
    seqs = [cache.admit(list(range(i * 100_000, i * 100_000 + n + 64))) for i, n in enumerate(lengths)]
    step = cache.begin_step(seqs, lengths)
    step.layers_done.update(range(layers))  # nothing to compute: the contents are never read
    cache.end_step(step)
    return cache, seqs


def decode_step(cache: StratifiedKVCache, seqs: list, layers: int) -> Callable[[], list[float]]:
    """One decode step (begin, every layer's attention, cancel): seconds per layer call."""
    n = len(seqs)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, D, generator=g).bfloat16().to(cache.device) for h in (HQ, HKV, HKV))
    scale = 1 / math.sqrt(D)

    def run() -> list[float]:
        step = cache.begin_step(seqs, [1] * n)
        times = []
        for layer in range(layers):
            start = time.perf_counter()
            cache.attention(layer, step, q, k, v, scale, kernels=True)
            times.append(time.perf_counter() - start)
        cache.cancel_step(step)  # the lengths stay put between repeats
        return times

    return run


def measure(run: Callable[[], list[float]], repeats: int) -> tuple[float, float]:
    """Median microseconds of the first layer and of the others over ``repeats`` steps."""
    run()
    firsts, rest = [], []
    for _ in range(repeats):
        times = run()
        firsts.append(times[0])
        rest.extend(times[1:])
    return statistics.median(firsts) * 1e6, statistics.median(rest) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--codec", default="fp8_e4m3")
    ap.add_argument("--device", default="meta", help="meta: torch ops do no work (as CUDA's async launches)")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--profile", action="store_true", help="cProfile the current code's steps")
    args = ap.parse_args()
    tune_malloc()
    torch.set_num_threads(1)
    cache, seqs = build(args.batch, args.context, args.layers, args.codec, args.device)
    run = decode_step(cache, seqs, args.layers)
    print(f"B={args.batch}, context ~{args.context}, {args.codec}, {args.layers} layers, launches off")
    with no_launches():
        results = {}
        for name, per_step in (("baseline (plan per layer)", False), ("current", True)):
            attend.PER_STEP_LAUNCH = per_step
            results[name] = measure(run, args.repeats)
        for name, (first, other) in results.items():
            per_layer_32 = (first + 31 * other) / 32
            print(
                f"{name:28s} first layer {first:8.1f} us  other layers {other:7.1f} us"
                f"  (32-layer step: {per_layer_32 * 32 / 1e3:6.2f} ms)"
            )
        (_, base), (_, cur) = results.values()
        print(f"other layers: current / baseline = {cur / base:.3f}")
        if args.profile:
            prof = cProfile.Profile()
            prof.enable()
            for _ in range(args.repeats):
                run()
            prof.disable()
            pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
