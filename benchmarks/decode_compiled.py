"""The 8/16-bit decode kernel compiled for an H200 (sm_90) on a machine without a GPU: registers, stack,
shared memory and the instructions of each loop of its SASS (docs/kernels-h200.md, pass 9).

    python benchmarks/decode_compiled.py fp8_e4m3 64 32768 [codes_asm=True wide.lazy_rescale=True ...]

Builds the step `attention_gpu.py` times (8B layer, codec, batch, context) on CPU tensors, takes the
launch `attend.pass_launch` gives it with `DECODE_LAUNCH[False]` (``key=value``) and
`FP8_WIDE_DECODE` (``wide.key=value``) updated, and compiles `decode._decode_kernel` with the
constexprs a BF16 model gets on the GPU (FP16 code operands, `decode.fp8_options` recomputed for
them). A loop's forward branches are reported with the instructions they skip (``lazy_rescale``: the
rescale a tile that keeps the running max does not run). Run it with the GPU's Triton version (its
compiler and `cuobjdump` come with the wheel); `decode4_compiled.py` is the 4-bit kernel's twin.
"""

from __future__ import annotations

import argparse
import ast
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).parent))
from decode4_compiled import OPS, compile_sm90, copy_waits, launch_args, loops, step  # noqa: E402

from kvstrata.radix.kernels import attend, decode  # noqa: E402

OPS_8BIT = [*OPS, "LDSM", "FMNMX", "IADD3", "SEL", "QGMMA", "HGMMA", "WARPGROUP"]


def compile_case(codec: str, batch: int, context: int, arch: str | None = None):
    """``(launch, options, compiled kernel)`` of the step with the current launch tables; ``arch``:
    Triton's lowering for that compute capability (``--arch``), the PTX still compiled for sm_90."""
    cache, plan, q, k, v = step(codec, batch, context)
    k_fmt, kp, v_fmt, vp = attend.layer_parts(cache.pool, 0)
    launch = attend.pass_launch(plan, k_fmt, v_fmt, q, k, v, 0.088, cache.ring, None, None, True, True)
    if launch.kernel is not decode._decode_kernel:
        raise SystemExit(f"{codec} decodes by {launch.kernel.__name__}, not decode._decode_kernel")
    options = dict(launch.options)
    options.update(DOT_PREC="tf32", DOT_DTYPE=tl.bfloat16, CODE_DTYPE=tl.float16 if k_fmt else tl.bfloat16)
    entry = dict(attend.DECODE_LAUNCH[False])
    n_pages, least = plan.page_table.shape[1], entry.get("min_pages", attend.MIN_PAGES_PER_SPLIT)
    if attend.takes_wide_decode(k_fmt, v_fmt, plan.batch * k.shape[1], n_pages, None, least, plan.page_size):
        entry.update(attend.FP8_WIDE_DECODE)
    options.update(decode.fp8_options(entry, options, options["SWAP"], options["HALVES"]))
    pairs = options["VALUE_PAIRS"] or options["KEYS_AS_ROWS"]
    options["PAIRS_ASM"] = pairs and options["CODE_DTYPE"] == tl.float16
    args = launch_args(cache, plan, q, k, v, launch)
    return launch, options, compile_sm90(decode._decode_kernel, args, dict(options, arch=arch))


def skipped(body: list[str]) -> list[int]:
    """Instructions each forward conditional branch of a loop body skips (`loops`' bodies: the last
    instruction branches back to the first; sm_90 instructions are 16 bytes)."""
    start = int(re.search(r"BRA\s+(?:.*?)(0x[0-9a-f]+)", body[-1]).group(1), 16)
    spans = []
    for i, text in enumerate(body[:-1]):
        if (b := re.search(r"^@!?P\w+\s+BRA\s+(?:.*?)(0x[0-9a-f]+)", text)) and int(
            b.group(1), 16
        ) > start + 16 * i:
            spans.append((int(b.group(1), 16) - start) // 16 - i - 1)
    return spans


def shared_wavefronts(body: list[str]) -> int:
    """Shared-memory wavefronts of a loop body's loads and stores, at one a 128 bytes a warp (no bank
    conflicts counted): byte to 32-bit accesses 1, 64-bit 2, 128-bit 4, ``ldmatrix`` one a matrix."""
    total = 0
    for text in body:
        op = re.sub(r"^@!?U?P\w+\s+", "", text).split()[0]
        parts = op.split(".")
        if parts[0] in ("LDS", "STS"):
            total += {"64": 2, "128": 4}.get(parts[-1], 1)
        elif parts[0] in ("LDSM", "STSM"):
            total += int(parts[-1]) if parts[-1].isdigit() else 1
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("codec")
    ap.add_argument("batch", type=int)
    ap.add_argument("context", type=int)
    ap.add_argument("launch", nargs="*", help="DECODE_LAUNCH[False] (wide.: FP8_WIDE_DECODE) key=value")
    ap.add_argument("--sass", help="write the SASS here")
    ap.add_argument(
        "--arch",
        help="lower for this capability (e.g. sm89: Triton 3.6 then keeps FP8 dots as FP8 mma.sync, which "
        "it promotes to FP16 for sm_90), the PTX still compiled for sm_90",
    )
    args = ap.parse_args()
    for item in args.launch:
        key, value = item.split("=", 1)
        table = attend.FP8_WIDE_DECODE if key.startswith("wide.") else attend.DECODE_LAUNCH[False]
        table[key.removeprefix("wide.")] = ast.literal_eval(value)
    launch, options, kernel = compile_case(args.codec, args.batch, args.context, args.arch)
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage, sass = (
            subprocess.run(
                [bin_dir / "cuobjdump", flag, f.name], capture_output=True, text=True, check=True
            ).stdout
            for flag in ("--dump-resource-usage", "-sass")
        )
    finally:
        os.unlink(f.name)
    regs, stack = re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1)
    print(
        f"{args.codec} B={args.batch} context {args.context}, Triton {triton.__version__}: "
        f"grid {launch.grid}, "
        f"num_warps {options['num_warps']}, BLOCK_N {options['BLOCK_N']}, CODES_ASM {options['CODES_ASM']}, "
        f"LAZY_RESCALE {options['LAZY_RESCALE']}, FP8_DOT {options['FP8_DOT']}, SWAP {options['SWAP']}"
        + (f", lowered for {args.arch}" if args.arch else "")
        + f"; {regs} registers, {stack} bytes of stack, "
        f"{kernel.metadata.shared} bytes of shared memory"
    )
    for i, body in enumerate(loops(sass)):
        ops = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        branches = skipped(body)
        print(
            f"  loop {i}: {len(body)} instructions"
            + (f" (forward branches skip {branches})" if branches else "")
            + f", {shared_wavefronts(body)} shared-memory wavefronts{copy_waits(body)}; "
            + " ".join(f"{op} {ops[op]}" for op in OPS_8BIT if ops[op])
        )
    if args.sass:
        Path(args.sass).write_text(sass)


if __name__ == "__main__":
    main()
