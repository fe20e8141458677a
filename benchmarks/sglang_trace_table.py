"""Where a served SGLang decode step's GPU time goes: a kernel table of an SGLang profiler trace.

    python benchmarks/sglang_trace_table.py TRACE.trace.json.gz [--layers 32] [--title NAME]

``TRACE`` is what SGLang's ``/start_profile`` writes (``{"num_steps": N, "activities": ["GPU"]}``;
`sglang_plugin_gpu.sh` sends it with ``PROFILE_STEPS`` once the server logs a decode batch of every
running request, so the steps profiled are decode steps; SGLang stops about one step after ``N``).
Steps are counted as the decode attention launches over ``--layers``. Prints, per step: the GPU window
(first kernel's start to the last one's end), the time some kernel ran (the union of kernel
intervals) and the rest (the GPU idle: host work, launches, waits), kernel time by kind, and the
kernels that took the most. Kinds are `decode_step_gpu.kernel_kind`'s, plus SGLang triton's own
decode attention (``_fwd_*kernel_stage1/2``), so a kvstrata server and SGLang's own backend compare
in one table.
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from decode_step_gpu import busy_us, kernel_kind  # noqa: E402

TOP = 12
# Decode attention kernels, one launch a layer a step: kvstrata's and SGLang triton's (GQA and MHA).
ATTENTION_KERNELS = ("_decode4_kernel", "_decode_kernel", "_attend_kernel", "_fwd_grouped_kernel_stage1")
ATTENTION_KERNELS += ("_fwd_kernel_stage1",)


def kind_of(name: str) -> str:
    if name.startswith("_fwd_") and "stage" in name:
        return "attention (SGLang triton)"
    return kernel_kind(name)


def kernels(trace: dict) -> list[tuple[float, float, str]]:
    """(start, end, name) in microseconds of every GPU kernel of the trace, by start."""
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    out = [
        (float(e["ts"]), float(e["ts"]) + float(e["dur"]), str(e.get("name", "")))
        for e in events
        if e.get("ph") == "X" and e.get("cat") == "kernel" and float(e.get("dur", 0)) > 0
    ]
    return sorted(out)


def count_steps(spans: list[tuple[float, float, str]], layers: int) -> float:
    return sum(1 for _, _, name in spans if name in ATTENTION_KERNELS) / layers


def table(spans: list[tuple[float, float, str]], steps: float, title: str) -> str:
    if not spans or not steps:
        return f"#### {title}: no decode step in the trace\n"
    wall = (spans[-1][1] - spans[0][0]) / steps / 1e3
    busy = busy_us(spans) / steps / 1e3
    by_kind: dict[str, float] = {}
    by_name: dict[str, tuple[float, int]] = {}
    for s, e, name in spans:
        by_kind[kind_of(name)] = by_kind.get(kind_of(name), 0.0) + (e - s)
        ms, n = by_name.get(name[:90], (0.0, 0))
        by_name[name[:90]] = (ms + (e - s), n + 1)
    lines = [
        f"#### {title}: {steps:g} steps, {len(spans) / steps:.0f} kernels a step; per step: GPU window "
        f"{wall:.2f} ms, kernels running {busy:.2f} ms, idle {wall - busy:.2f} ms",
        "",
        "| kind | ms/step | share of window |",
        "|---|---:|---:|",
    ]
    for kind, us in sorted(by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {kind} | {us / steps / 1e3:.3f} | {100 * us / steps / 1e3 / wall:.1f}% |")
    lines += ["", "| top kernels | launches/step | ms/step |", "|---|---:|---:|"]
    top = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:TOP]
    lines += [f"| `{name}` | {n / steps:.1f} | {us / steps / 1e3:.3f} |" for name, (us, n) in top]
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("trace", help="an SGLang profiler trace (.trace.json.gz or .json)")
    ap.add_argument("--layers", type=int, default=32, help="attention layers of the served model")
    ap.add_argument("--title", default=None)
    args = ap.parse_args()
    path = Path(args.trace)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        trace = json.load(f)
    spans = kernels(trace)
    print(table(spans, count_steps(spans, args.layers), args.title or path.name))


if __name__ == "__main__":
    main()
