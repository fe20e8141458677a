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
each step, as in steady serving. Prints the median microseconds of a layer's call (the first layer of
a step apart: it works out the step's launches) and the torch operators it dispatches (each a launch
or an allocation on a GPU), for this code and for ``--baseline`` (another checkout, measured the same
way in a subprocess of the same run). CPU torch ops do their (small) work, so the microseconds are
this machine's, not a GPU host's: compare the ratio and the operator counts.

    python benchmarks/attention_host.py --baseline /path/to/main/checkout [--profile]
"""

from __future__ import annotations

import argparse
import cProfile
import inspect
import json
import math
import pstats
import statistics
import time
from collections.abc import Callable
from contextlib import contextmanager

import torch
from checkout import measure_checkout

from kvstrata.engine.malloc import tune_malloc
from kvstrata.radix import CacheConfig, StratifiedKVCache
from kvstrata.radix.kernels import attend, decode, decode4, extend, page_quantize

HQ, HKV, D = 32, 8, 128
PAGE = 16
KERNELS = (
    decode._decode_kernel,
    decode4._decode4_kernel,
    attend._attend_kernel,
    attend._extend_kernel,
    extend._flash_extend_kernel,
    attend._dequant_kernel,
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


def decode_step(cache: StratifiedKVCache, seqs: list, layers: int) -> Callable[..., list[float]]:
    """One decode step (begin, every layer's attention as the decode graphs call it, cancel): seconds
    per layer call."""
    n = len(seqs)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, h, D, generator=g).bfloat16().to(cache.device) for h in (HQ, HKV, HKV))
    scale = 1 / math.sqrt(D)
    attn_out = torch.empty_like(q)  # the decode graphs' static output buffer
    writes_out = "out" in inspect.signature(cache.attention).parameters  # else: the engine copies

    def run(profile: cProfile.Profile | None = None) -> list[float]:
        """``profile``: enabled around the calls of every layer but the first."""
        step = cache.begin_step(seqs, [1] * n)
        times = []
        for layer in range(layers):
            if profile is not None and layer:
                profile.enable()
            start = time.perf_counter()
            if writes_out:
                cache.attention(layer, step, q, k, v, scale, kernels=True, out=attn_out)
            else:
                attn_out.copy_(cache.attention(layer, step, q, k, v, scale, kernels=True))
            times.append(time.perf_counter() - start)
            if profile is not None:
                profile.disable()
        cache.cancel_step(step)  # the lengths stay put between repeats
        return times

    return run


def aten_ops(run: Callable[..., list[float]]) -> float:
    """Torch operators a layer dispatches (each one a launch or an allocation on a GPU): one step's
    count over its layers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            Count.n += 1
            return func(*args, **(kwargs or {}))

    with Count():
        layers = len(run())
    return Count.n / layers


def python_us(run: Callable[..., list[float]], repeats: int, layers: int) -> tuple[float, pstats.Stats]:
    """Microseconds a layer (past the first) spends in Python outside torch's operators, by cProfile
    (its own overhead included; the same for both codes), and the profile."""
    prof = cProfile.Profile()
    for _ in range(repeats):
        run(prof)
    stats = pstats.Stats(prof)
    total = ops = 0.0
    for (file, _, name), (_, _, tottime, _, _) in stats.stats.items():  # type: ignore[attr-defined]
        total += tottime
        if file == "~" and ("torch" in name or "TensorBase" in name):
            ops += tottime
    return (total - ops) / (repeats * (layers - 1)) * 1e6, stats


def measure(run: Callable[..., list[float]], repeats: int, layers: int) -> dict[str, float]:
    """Median microseconds of the first layer and of the others over ``repeats`` steps, their Python
    part outside torch's operators, and torch operators per layer."""
    run()
    firsts, rest = [], []
    for _ in range(repeats):
        times = run()
        firsts.append(times[0])
        rest.extend(times[1:])
    return {
        "first": statistics.median(firsts) * 1e6,
        "other": statistics.median(rest) * 1e6,
        "python": python_us(run, repeats, layers)[0],
        "ops": aten_ops(run),
    }


def baseline(args: argparse.Namespace) -> dict[str, float]:
    """The same measurement of the code under ``args.baseline`` (a checkout), in a subprocess."""
    options = ("batch", "context", "layers", "codec", "device", "repeats")
    return measure_checkout(__file__, args.baseline, args, options)


def report(name: str, r: dict[str, float]) -> None:
    print(
        f"{name:10s} first layer {r['first']:8.1f} us   other layers {r['other']:7.1f} us"
        f"   of which Python {r['python']:6.1f} us   torch ops a layer {r['ops']:5.1f}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--codec", default="fp8_e4m3")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--baseline", help="a checkout whose kvstrata is measured the same way, first")
    ap.add_argument("--profile", action="store_true", help="cProfile this code's steps")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    base = baseline(args) if args.baseline else None
    tune_malloc()
    torch.set_num_threads(1)
    cache, seqs = build(args.batch, args.context, args.layers, args.codec, args.device)
    run = decode_step(cache, seqs, args.layers)
    with no_launches():
        got = measure(run, args.repeats, args.layers)
        if args.json:
            print(json.dumps(got))
            return
        print(f"B={args.batch}, context ~{args.context}, {args.codec}, {args.layers} layers, launches off")
        if base is not None:
            report("baseline", base)
        report("this code", got)
        if base is not None:
            for key, what in (("other", "other layers"), ("python", "their Python")):
                print(f"{what}: this code / baseline = {got[key] / base[key]:.3f}")
        if args.profile:
            python_us(run, args.repeats, args.layers)[1].sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
