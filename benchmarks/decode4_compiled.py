"""The 4-bit decode kernel compiled for an H200 (sm_90) on a machine without a GPU: registers, stack and
the instructions of each loop of its SASS (docs/kernels-h200.md, passes 6-8, "compiled code").

    python benchmarks/decode4_compiled.py int4 256 2048 [heads_together=True maxnreg=168 ...] [--sass F]

Builds the step `attention_gpu.py` times (8B layer, codec, batch, context) on CPU tensors, takes the
launch `attend.pass_launch` gives it with `DECODE_LAUNCH[True]` updated by the ``key=value`` arguments
(which also win over `attend.decode4_launch`'s per-layer keys, e.g. int4's one stage, its turned
tail and the H200's register cap; the launch is the one an H200 runs),
and compiles `_decode4_kernel` with the constexprs a BF16 model gets on the GPU (FP16 code operands,
the packed PTX), 16-byte aligned pointers where a launch has them. Run it with the GPU's Triton
version (its compiler and `cuobjdump` come with the wheel): other versions compile other code.
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

import torch
import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, str(Path(__file__).parent))
from attention_gpu import GEOMETRIES, build  # noqa: E402

from kvstrata.radix.kernels import attend, decode4  # noqa: E402

TYPES = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    torch.float32: "fp32",
    torch.uint8: "u8",
    torch.int8: "i8",
    torch.int16: "i16",
    torch.int32: "i32",
    torch.int64: "i64",
}
# Counted per loop: loads and stores (global, async copies, shared, spills), products, shuffles,
# barriers, special functions and the arithmetic the decoding and softmax take.
OPS = ["LDG", "LDGSTS", "LDS", "STS", "LDL", "STL", "HMMA", "SHFL", "BAR", "MUFU", "LOP3", "PRMT", "F2FP"]
OPS += ["HADD2", "HFMA2", "FMUL", "FADD", "FFMA", "IMAD"]


# COMPILED_GEOMETRY (environment): the `attention_gpu.GEOMETRIES` key of the layer compiled, "8b" unless set.
GEOMETRY = os.environ.get("COMPILED_GEOMETRY", "8b")


def step(codec: str, batch: int, context: int):
    """`attention_gpu.build`'s step on the CPU, its shapes only: cache, plan, q, k, v."""
    return build(codec, batch, context, *GEOMETRIES[GEOMETRY], device="cpu", fill=False)[:5]


def _type(arg) -> str:
    """A runtime argument's type in Triton's signature."""
    if isinstance(arg, torch.Tensor):
        return "*" + TYPES[arg.dtype]
    return "fp32" if isinstance(arg, float) else "i32"


def compile_sm90(fn, args: list, options: dict):
    """``fn`` compiled for an H200 (sm_90) as a launch with runtime ``args`` (in order) and keyword
    ``options`` (its constexprs, ``num_warps``, ``num_stages``, ``maxnreg``; ``arch``: the compute
    capability Triton lowers for, e.g. "sm89", where PTX and SASS stay sm_90's) compiles it: tensors 16-byte
    aligned except `jit_unspecialized`'s pointers. Tensors among ``options`` (a decode kernel's
    ``COUNT``, `attend.merge_options`) are runtime arguments given by keyword, after ``args``."""
    names = fn.arg_names
    by_keyword = [options[n] for n in names if isinstance(options.get(n), torch.Tensor)]
    options = {n: value for n, value in options.items() if not isinstance(value, torch.Tensor)}
    args = [*args, *by_keyword]
    runtime = [n for n in names if n not in options]
    assert len(runtime) == len(args), (runtime, len(args))
    sig = {n: _type(a) for n, a in zip(runtime, args, strict=True)}
    unaligned = set(attend.DECODE_POINTERS)  # `jit_unspecialized`'s pointers
    attrs = {
        (i,): [["tt.divisibility", 16]]
        for i, n in enumerate(names)
        if sig.get(n, "").startswith("*") and n not in unaligned
    }
    constexprs = {(i,): options[n] for i, n in enumerate(names) if n in options}
    src = ASTSource(
        fn=fn, signature={n: sig.get(n, "constexpr") for n in names}, constexprs=constexprs, attrs=attrs
    )
    target_options = {n: options[n] for n in ("num_warps", "num_stages", "maxnreg", "arch") if options.get(n)}
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=target_options)


def launch_args(cache, plan, q, k, v, launch) -> list:
    """The runtime arguments `PassLaunch.run` gives the step's kernel (one layer, no sinks)."""
    k_fmt, kp, v_fmt, vp = attend.layer_parts(cache.pool, 0)
    ring_k, ring_v = attend.layer_kv(cache.ring, 0)
    cold_len, ring_len, sink_len = launch.lengths
    partial = torch.empty(1)
    args = [q, k, v, q, partial, partial, plan.page_table, cold_len, *kp, *vp, sink_len, sink_len]
    return args + [ring_k, ring_v, plan.ring_rows, ring_len, ring_k, ring_v, *launch.scalars]


def compile_case(codec: str, batch: int, context: int):
    """``(launch, options, compiled kernel)`` of the step with the current `DECODE_LAUNCH[True]`, as the
    layer runs it on an H200 (`attend.decode4_launch`: int4's own shape, its tail turned over at 128
    registers in launches of many rows, wider heads uncapped)."""
    cache, plan, q, k, v = step(codec, batch, context)
    k_fmt, kp, v_fmt, vp = attend.layer_parts(cache.pool, 0)
    launch = attend.pass_launch(plan, k_fmt, v_fmt, q, k, v, 0.088, cache.ring, None, None, True, True)
    meta = {
        n: launch.options[n] for n in ("D", "BLOCK_D", "P", "K_FMT", "V_FMT", "HAS_SINKS", "SPLIT", "NORM_W")
    }
    meta.update(DOT_PREC="tf32", DOT_DTYPE=tl.bfloat16, CODE_DTYPE=tl.bfloat16)  # a BF16 model on a GPU
    rows = plan.batch * k.shape[1]
    entry = attend.DECODE_LAUNCH[True]  # the launch an H200 runs (per-card choices: its name)
    table = attend.decode4_launch(entry, k_fmt, v_fmt, meta["D"], meta["P"], rows, "NVIDIA H200")
    options = decode4.decode4_options(q.shape[1] // k.shape[1], table, False, meta)
    options.update({n: launch.options[n] for n in ("COUNT", "MERGE_S", "MERGE_G")})  # its split merge
    args = launch_args(cache, plan, q, k, v, launch)
    return launch, options, compile_sm90(decode4._decode4_kernel, args, options)


def sass_of(kernel) -> tuple[str, str, str]:
    """``(registers, bytes of stack, SASS)`` of a compiled kernel, read with the wheel's cuobjdump."""
    bin_dir = Path(triton.__file__).parent / "backends/nvidia/bin"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(kernel.asm["cubin"])
    try:
        usage = subprocess.run(
            [bin_dir / "cuobjdump", "--dump-resource-usage", f.name],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        sass = subprocess.run(
            [bin_dir / "cuobjdump", "-sass", f.name], capture_output=True, text=True, check=True
        ).stdout
    finally:
        os.unlink(f.name)
    return re.search(r"REG:(\d+)", usage).group(1), re.search(r"STACK:(\d+)", usage).group(1), sass


def copy_waits(body: list[str]) -> str:
    """The waits for asynchronous copies in a loop (``DEPBAR.LE SB0, n``: until at most n copy groups are
    outstanding; 0 waits for every copy issued, the next tile's included, so none is in flight while
    the loop computes), e.g. "copy waits 0x2", or "" where the loop has none."""
    waits = [m.group(1) for t in body if (m := re.search(r"DEPBAR\.LE SB0, (0x[0-9a-f]+)", t))]
    return f", copy waits {' '.join(waits)}" if waits else ""


def loop_counts(sass: str, ops: list[str]) -> list[str]:
    """Each loop's instruction count, its waits for copies (`copy_waits`) and its count of each of
    ``ops``, one line a loop."""
    lines = []
    for i, body in enumerate(loops(sass)):
        count = collections.Counter(re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for t in body)
        lines.append(
            f"  loop {i}: {len(body)} instructions{copy_waits(body)}; "
            + " ".join(f"{op} {count[op]}" for op in ops if count[op])
        )
    return lines


def set_launch(entry: dict, items: list[str]) -> None:
    """Set ``key=value`` items (values as Python literals) in a launch-table entry."""
    for item in items:
        key, value = item.split("=", 1)
        entry[key] = ast.literal_eval(value)


def report(kernel, head: str, ops: list[str], sass_path: str | None) -> None:
    """Print ``head`` with the kernel's registers, stack and shared memory, then each loop's counts of
    ``ops``; write the SASS to ``sass_path`` if given."""
    regs, stack, sass = sass_of(kernel)
    print(
        f"{head}; {regs} registers, {stack} bytes of stack, {kernel.metadata.shared} bytes of shared memory"
    )
    print("\n".join(loop_counts(sass, ops)))
    if sass_path:
        Path(sass_path).write_text(sass)


def loops(sass: str) -> list[list[str]]:
    """The instructions of each loop (a backward branch's target to the branch), in program order."""
    addresses: list[int] = []
    instructions: list[str] = []
    for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+(.*?);", sass):
        addresses.append(int(m.group(1), 16))
        instructions.append(m.group(2).strip())
    index = {a: i for i, a in enumerate(addresses)}
    spans = set()
    for i, text in enumerate(instructions):
        if (b := re.search(r"BRA\s+(?:.*?)(0x[0-9a-f]+)", text)) and int(b.group(1), 16) < addresses[i]:
            spans.add((index[int(b.group(1), 16)], i + 1))
    return [instructions[a:b] for a, b in sorted(spans)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("codec", choices=["int4", "fp4_e2m1"])
    ap.add_argument("batch", type=int)
    ap.add_argument("context", type=int)
    ap.add_argument("launch", nargs="*", help="DECODE_LAUNCH[True] overrides, key=value (Python literals)")
    ap.add_argument("--sass", help="write the SASS here")
    args = ap.parse_args()
    overrides: dict = {}
    set_launch(overrides, args.launch)
    entries = (attend.DECODE_LAUNCH[True], attend.INT4_DECODE, attend.DECODE4_PASS12, attend.INT4_TURNED_TAIL)
    for entry in entries:
        entry.update(overrides)  # over the per-layer keys too, in the launch's splits and merge as well
    if "maxnreg" in overrides:  # and over the per-card register caps
        attend.INT4_TURNED_MAXNREG.update(dict.fromkeys(attend.INT4_TURNED_MAXNREG, overrides["maxnreg"]))
    launch, options, kernel = compile_case(args.codec, args.batch, args.context)
    head = (
        f"{args.codec} B={args.batch} context {args.context}, Triton {triton.__version__}: "
        f"grid {launch.grid}, BLOCK_H {options['BLOCK_H']}, SLOT_R {options['SLOT_R']}"
    )
    report(kernel, head, OPS, args.sass)


if __name__ == "__main__":
    main()
