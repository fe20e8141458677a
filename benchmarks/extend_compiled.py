"""The extend kernels compiled for an H200 (sm_90) on a machine without a GPU: registers, stack, shared
memory and the instructions of each loop of the SASS (docs/kernels-h200.md, pass 9).

    python benchmarks/extend_compiled.py bf16 [module='extend' block_n=128 num_stages=3 ...] [--sass F]

Builds the step `attention_sweep.py` times for extend (8B layer, one sequence, a 2,048-token chunk over
30,720 cached tokens) on CPU tensors, takes the launch `attend.pass_launch` gives it with the codec's
`EXTEND_LAUNCH` entry updated by the ``key=value`` arguments, and compiles its kernel (`attend`'s, or
`extend`'s with ``module='extend'``) with the constexprs a BF16 model gets on the GPU (BF16 dots, FP16
operands for FP8 codes). Run it with the GPU's Triton version first on the path: other versions
compile other code. Loops in program order: the cold tiles, the partial last cold tile's none (no
loop), the ring, then the new tokens (the flash kernel: unmasked tiles, then the diagonal's).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from attention_gpu import GEOMETRIES, build  # noqa: E402
from decode4_compiled import OPS, compile_sm90, launch_args, report, set_launch  # noqa: E402

from kvstrata.radix.kernels import attend  # noqa: E402

# Besides decode4_compiled's counts: warp-group products and their waits, async copies and waits.
EXTEND_OPS = [*OPS, "HGMMA", "WARPGROUP", "LDGDEPBAR", "DEPBAR", "FMNMX", "FSEL"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("codec", choices=["bf16", "fp8_e4m3", "fp8_e5m2"])
    ap.add_argument("launch", nargs="*", help="EXTEND_LAUNCH overrides, key=value (Python literals)")
    ap.add_argument("--sass", help="write the SASS here")
    args = ap.parse_args()
    cache, plan, q, k, v = build(
        args.codec, 1, 32768, *GEOMETRIES["8b"], tokens=2048, device="cpu", fill=False
    )[:5]
    k_fmt, _, v_fmt, _ = attend.layer_parts(cache.pool, 0)
    entry = attend.EXTEND_LAUNCH[attend.extend_kind(k_fmt, v_fmt)]
    set_launch(entry, args.launch)
    launch = attend.pass_launch(plan, k_fmt, v_fmt, q, k, v, 0.088, cache.ring, None, None, True, True)
    options = dict(launch.options)
    codes = (k_fmt, v_fmt) != (0, 0)  # the CPU launch has float32 operands: a GPU's BF16 model's here
    f16 = entry["f16_codes"] and codes
    options.update(DOT_PREC="tf32", DOT_DTYPE=tl.bfloat16, CODE_DTYPE=tl.float16 if f16 else tl.bfloat16)
    options["NORM_W"] = f16
    kernel = compile_sm90(launch.kernel, launch_args(cache, plan, q, k, v, launch), options)
    name = getattr(launch.kernel, "__name__", launch.kernel.fn.__name__)
    head = f"{args.codec} {entry}: {name}, grid {launch.grid}, BLOCK_M {options['BLOCK_M']}"
    report(kernel, head, EXTEND_OPS, args.sass)


if __name__ == "__main__":
    main()
