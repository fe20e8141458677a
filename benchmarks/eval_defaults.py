"""Reproduce the accuracy-lab runs behind the shipped KV defaults (docs/eval.md).

    python benchmarks/eval_defaults.py --out-dir lab/ [--device cuda] [--model PATH] [--corpus FILE]
        [--only defaults,fp4w0,ctx4096,sweep8,sweep4,outliers]

Each run writes lab/<name>.json, .md (and .png for the main ones) and prints its table; every table is
drift against the unquantized reference measured in the same run. On the project's 2-core CPU a run costs
about 7 minutes per configuration at 32,768 tokens; on one H200 (--device cuda) all of them take ~15 min.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from kvstrata.cli import main as kvstrata_main

RUNS: dict[str, list[str]] = {
    "defaults": ["--emit-plan", "{out}/plan.json", "--plan-window", "512", "--plot", "{out}/defaults.png"],
    "fp4w0": ["--configs", "fp4_e2m1", "--recent-window", "0", "--sinks", "off", "--rotation", "off"],
    "ctx4096": ["--context", "4096", "--configs", "fp4_e2m1"],
    "sweep8": [
        "--configs", "auto,bf16,fp8_e4m3,fp8_e5m2,int8", "--recent-window", "0,64,128", "--sinks", "off,on",
        "--plot", "{out}/sweep8.png",
    ],
    "sweep4": [
        "--configs", "int4,fp4_e2m1", "--recent-window", "128,256,512", "--sinks", "on",
        "--rotation", "off,hadamard", "--plot", "{out}/sweep4.png",
    ],
    "outliers": ["--model", "{out}/planted", "--configs", "auto,fp8_e4m3,int8,int4,fp4_e2m1"],
}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out-dir", required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default=None)
    parser.add_argument("--corpus", default=None)
    parser.add_argument("--tokens", default="32768")
    parser.add_argument("--only", default=",".join(RUNS))
    args = parser.parse_args(argv)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for name in args.only.split(","):
        if name == "outliers" and not (out / "planted").is_dir():
            from kvstrata.eval.outliers import plant_outliers_in_model

            plant_outliers_in_model(args.model, out / "planted")
        extra = [a.format(out=out) for a in RUNS[name]]
        common = ["eval", "--device", args.device, "--tokens", args.tokens]
        common += ["--out", str(out / f"{name}.json"), "--markdown", str(out / f"{name}.md")]
        if args.model and "--model" not in extra:
            common += ["--model", args.model]
        if args.corpus:
            common += ["--corpus", args.corpus]
        print(f"== {name}: kvstrata {' '.join(common + extra)}", file=sys.stderr, flush=True)
        rc = kvstrata_main(common + extra)
        if rc:
            return rc
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
