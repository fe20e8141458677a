"""Why an attention kernel runs at the speed it does: Nsight Compute's counters for one launch of each case.

    python benchmarks/ncu_attention.py [--cases fp8_e4m3:64:32768,bf16:64:32768,sdpa:64:32768] [--out DIR]

A case is ``CODEC:BATCH:CONTEXT`` (the Triton decode over that codec's strata, as
`attention_gpu.py` builds them at the Llama-3-8B layer geometry) or ``sdpa:BATCH:CONTEXT`` (torch
SDPA over contiguous BF16 K/V, the bandwidth reference). Each case runs in its own process under
``ncu --profile-from-start off`` (the script warms the kernels up, flushes L2, then brackets one
call with the CUDA profiler's start/stop), so every kernel of that one call is profiled: the
attention kernel and, with split-KV, its merge. ``--clock-control none`` leaves the clocks as they
are (the device notes ask for it), so times match `attention_gpu.py`'s within a run's spread.

Written to DIR per case: the report (``.ncu-rep``), ncu's details page as text, its raw page as CSV and
its source page as CSV (``.sass.csv``: every SASS instruction with its warp-state samples). Printed last,
one row per kernel: time, DRAM bytes read and the share of DRAM peak, theoretical and achieved occupancy,
registers, the schedulers' issue share, eligible / active warps a scheduler, and the four largest warp-
stall reasons (cycles a warp spends stalled on each per issued instruction, Nsight Compute's
``smsp__average_warps_issue_stalled_*_per_issue_active``): ``long_scoreboard`` waits on global memory,
``short_scoreboard`` on shared memory and special functions, ``wait`` on a fixed-latency dependency,
``math_pipe_throttle`` / ``mio_throttle`` on a busy pipe or queue, ``barrier`` on ``__syncthreads``,
``not_selected`` on another eligible warp (issue-bound).

Needs a CUDA GPU and ``ncu`` (on PATH, or NCU=/path/to/ncu). ``table CSV...`` prints the table of
saved raw CSVs (no GPU needed).
"""

from __future__ import annotations

import argparse
import csv
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

DEFAULT_CASES = "fp8_e4m3:64:32768,bf16:64:32768,int4:64:32768,sdpa:64:32768,fp8_e4m3:256:2048,bf16:256:2048"
SECTIONS = (
    "SpeedOfLight",
    "Occupancy",
    "LaunchStats",
    "WarpStateStats",
    "SchedulerStats",
    "MemoryWorkloadAnalysis",
    "ComputeWorkloadAnalysis",
    "InstructionStats",
    "SourceCounters",  # warp-state samples by SASS instruction: the ``.sass.csv`` page
)
STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
NOT_STALLS = ("selected", "sleeping")  # "selected": the issuing warp itself (~1 by definition)
# Collected beside the sections (the base MemoryWorkloadAnalysis section leaves DRAM bytes to its tables).
METRICS = ("dram__bytes_read.sum",)
# (column title, metric names in order of preference, scale to the printed unit)
COLUMNS = [
    ("us", ("gpu__time_duration.sum",), 1e-3),
    ("DRAM read MB", ("dram__bytes_read.sum",), 1e-6),
    (
        "DRAM % peak",
        (
            "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed",
            "dram__throughput.avg.pct_of_peak_sustained_elapsed",
        ),
        1.0,
    ),
    ("occupancy % (theor.)", ("sm__maximum_warps_per_active_cycle_pct",), 1.0),
    ("occupancy % (achieved)", ("sm__warps_active.avg.pct_of_peak_sustained_active",), 1.0),
    ("regs", ("launch__registers_per_thread",), 1.0),
    ("issue %", ("smsp__issue_active.avg.pct_of_peak_sustained_active",), 1.0),
    ("eligible warps", ("smsp__warps_eligible.avg.per_cycle_active",), 1.0),
    ("active warps", ("smsp__warps_active.avg.per_cycle_active",), 1.0),
]


def number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def shown(value: float) -> str:
    return f"{value:.0f}" if abs(value) >= 100 else f"{value:.3g}"


def read_raw(path: Path) -> list[dict[str, str]]:
    """Rows of ncu's raw page as CSV (``--page raw --csv``): the header row holds the metric names,
    a units row may follow it (its "Kernel Name" cell is empty), then one row per profiled kernel.
    Lines before the header (ncu's own messages) are skipped."""
    lines = path.read_text().splitlines()
    start = next((i for i, line in enumerate(lines) if '"Kernel Name"' in line), None)
    if start is None:
        return []
    rows = list(csv.DictReader(lines[start:]))
    return [r for r in rows if r.get("Kernel Name")]


def kernel_rows(case: str, rows: list[dict[str, str]]) -> list[list[str]]:
    out = []
    for r in rows:
        cells = [case, r["Kernel Name"][:40]]
        for _, names, scale in COLUMNS:
            value = next((number(r[n]) for n in names if n in r and number(r[n]) is not None), None)
            cells.append("-" if value is None else shown(value * scale))
        stalls = sorted(
            (
                (m[1], v)
                for name, text in r.items()
                if (m := STALL.match(name)) and m[1] not in NOT_STALLS and (v := number(text))
            ),
            key=lambda s: -s[1],
        )
        cells.append(", ".join(f"{n} {shown(v)}" for n, v in stalls[:4]) or "-")
        out.append(cells)
    return out


def table(cases: list[tuple[str, Path]]) -> str:
    head = ["case", "kernel", *(c[0] for c in COLUMNS), "largest stalls (cycles / issued instruction)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for case, path in cases:
        rows = read_raw(path) if path.exists() else []
        if not rows:
            lines.append(f"| {case} | no kernel profiled (see {path.with_suffix('.log').name}) |")
        for cells in kernel_rows(case, rows):
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_case(case: str) -> None:
    """One case under ncu: warm up, flush L2, profile one call."""
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import attention_gpu as bench

    from kvstrata.radix.kernels import attend as kernels

    codec, batch, context = case.split(":")
    hq, hkv, d = bench.GEOMETRIES["8b"]
    if codec == "sdpa":
        fn, _ = bench.sdpa_case(int(batch), int(context), hq, hkv, d)
    else:
        cache, plan, q, k, v, _ = bench.build(codec, int(batch), int(context), hq, hkv, d)
        args = (0, plan, q, k, v, 1 / math.sqrt(d), cache.pool, cache.ring, None)

        def fn() -> None:
            kernels.attend_group(*args)

    for _ in range(3):
        fn()
    torch.empty(256 << 20, dtype=torch.int8, device="cuda").zero_()
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


def profile(cases: list[str], out: Path) -> list[tuple[str, Path]]:
    ncu = os.environ.get("NCU") or shutil.which("ncu")
    if ncu is None:
        found = sorted(Path("/opt/nvidia").glob("nsight-compute/*/ncu"))
        ncu = str(found[-1]) if found else None
    if ncu is None:
        raise SystemExit("no ncu: put it on PATH or set NCU")
    out.mkdir(parents=True, exist_ok=True)
    done = []
    for case in cases:
        name = case.replace(":", "_")
        report, raw, log = out / f"{name}.ncu-rep", out / f"{name}.csv", out / f"{name}.log"
        sections = [a for s in SECTIONS for a in ("--section", s)]
        cmd = [
            ncu,
            "--clock-control",
            "none",
            "--profile-from-start",
            "off",
            *sections,
            "--metrics",
            ",".join(METRICS),
            "-f",
            "-o",
            str(report),
        ]
        cmd += [sys.executable, __file__, "run", case]
        root = str(Path(__file__).resolve().parents[1])  # the checkout's kvstrata, installed or not
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        with log.open("w") as f:
            rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, env=env).returncode
        print(f"{case}: ncu exit {rc} ({log})", flush=True)
        if report.exists():
            with raw.open("w") as f:
                subprocess.run(
                    [ncu, "-i", str(report), "--page", "raw", "--csv", "--print-units", "base"], stdout=f
                )
            with (out / f"{name}.details.txt").open("w") as f:
                subprocess.run([ncu, "-i", str(report), "--page", "details"], stdout=f)
            with (out / f"{name}.sass.csv").open("w") as f:  # where in the loop the warps stall
                subprocess.run(
                    [ncu, "-i", str(report), "--page", "source", "--csv", "--print-source", "sass"], stdout=f
                )
        done.append((case, raw))
    return done


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "run":
        run_case(sys.argv[2])
        return
    if len(sys.argv) >= 2 and sys.argv[1] == "table":
        print(table([(Path(p).stem, Path(p)) for p in sys.argv[2:]]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument(
        "--cases", default=DEFAULT_CASES, help="comma-separated CODEC:BATCH:CONTEXT or sdpa:BATCH:CONTEXT"
    )
    ap.add_argument("--out", default="ncu-attention", help="directory for reports, logs and raw CSVs")
    a = ap.parse_args()
    done = profile(a.cases.split(","), Path(a.out))
    print("\n" + table(done))


if __name__ == "__main__":
    main()
