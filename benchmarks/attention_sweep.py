"""Launch-shape sweep of the Triton attention kernels on one GPU (picks `DECODE_LAUNCH`/`EXTEND_LAUNCH`).

    python benchmarks/attention_sweep.py

Times `kvstrata.radix.kernels.attend.attend_group` at the 8B layer geometry (32 query / 8 KV heads,
head_dim 128) on the same strata as `benchmarks/attention_gpu.py` builds, for several launch shapes:
decode at B=64 and B=1, context 32K (16-token blocks per tile, warps, pipeline stages, split-KV
target), and extend (a 2,048-token chunk over 30,720 cached tokens). Each line gives milliseconds,
achieved TB/s and the ratio to SDPA BF16 measured in the same run.
"""

from __future__ import annotations

import math
import sys
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import attention_gpu as bench  # noqa: E402

from kvstrata.radix.kernels import attend as kernels  # noqa: E402


def launch(blocks: int, warps: int, stages: int, target: int = 512, min_pages: int = 16) -> dict:
    return dict(blocks=blocks, num_warps=warps, num_stages=stages, target=target, min_pages=min_pages)


def decode(codecs: list[str], batch: int, context: int, shapes: list[dict]) -> None:
    hq, hkv, d = bench.GEOMETRIES["8b"]
    fn, _ = bench.sdpa_case(batch, context, hq, hkv, d)
    base = bench.bench(fn)
    print(f"SDPA bf16 B={batch} context={context}: {base:.3f} ms", flush=True)
    for codec in codecs:
        cache, plan, q, k, v, moved = bench.build(codec, batch, context, hq, hkv, d)
        args = (0, plan, q, k, v, 1 / math.sqrt(d), cache.pool, cache.ring, None)
        four_bit = codec in ("int4", "fp4_e2m1")
        for shape in shapes:
            shape = dict(shape)
            kernels.TARGET_PROGRAMS, kernels.MIN_PAGES_PER_SPLIT = shape.pop("target"), shape.pop("min_pages")
            kernels.DECODE_LAUNCH[four_bit].update(shape)
            ms = bench.bench(partial(kernels.attend_group, *args))
            split = f"T={kernels.TARGET_PROGRAMS}/{kernels.MIN_PAGES_PER_SPLIT}"
            print(
                f"  B={batch} {codec:9s} {shape} {split}: {ms:.3f} ms {moved / ms / 1e9:.2f} TB/s "
                f"x{base / ms:.2f}",
                flush=True,
            )
        cache = plan = q = k = v = None
        torch.cuda.empty_cache()


def extend(codecs: list[str], shapes: list[dict]) -> None:
    hq, hkv, d = bench.GEOMETRIES["8b"]
    fn, _ = bench.sdpa_case(1, 32768, hq, hkv, d, tokens=2048)
    base = bench.bench(fn)
    print(f"extend SDPA bf16 {base:.3f} ms", flush=True)
    for codec in codecs:
        cache, plan, q, k, v, _ = bench.build(codec, 1, 32768, hq, hkv, d, tokens=2048)
        args = (0, plan, q, k, v, 1 / math.sqrt(d), cache.pool, cache.ring, None)
        for shape in shapes:
            kernels.EXTEND_LAUNCH[codec in ("int4", "fp4_e2m1")].update(shape)
            ms = bench.bench(partial(kernels.attend_group, *args))
            print(f"  extend {codec:9s} {shape}: {ms:.3f} ms x{base / ms:.2f}", flush=True)
        cache = plan = q = k = v = None
        torch.cuda.empty_cache()


def main() -> None:
    shapes = [launch(2, 4, 2), launch(4, 4, 2), launch(4, 4, 3), launch(8, 4, 2), launch(8, 8, 2)]
    shapes += [launch(4, 4, 2, 2048), launch(2, 4, 2, 4096)]
    decode(["fp8_e4m3", "int4", "fp4_e2m1", "bf16"], 64, 32768, shapes)
    shapes = [launch(2, 4, 2), launch(4, 4, 2), launch(2, 4, 2, 2048, 8), launch(4, 4, 2, 2048, 8)]
    decode(["fp8_e4m3", "int4"], 1, 32768, shapes + [launch(2, 4, 2, 4096, 4)])
    extend(
        ["bf16", "fp8_e4m3", "int4"],
        [
            dict(block_m=128, block_n=64, blocks=4, num_warps=8, num_stages=2),
            dict(block_m=64, block_n=64, blocks=4, num_warps=4, num_stages=3),
            dict(block_m=128, block_n=128, blocks=8, num_warps=8, num_stages=3),
            dict(block_m=128, block_n=64, blocks=4, num_warps=4, num_stages=3),
        ],
    )


if __name__ == "__main__":
    main()
