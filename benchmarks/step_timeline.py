"""Summarize an engine step timeline (``KVSTRATA_STEP_TRACE=path.jsonl``, see kvstrata/engine/trace.py).

    python benchmarks/step_timeline.py trace.jsonl [more.jsonl ...]

Prints per file: totals per step kind (steps, tokens, wall, GPU time from CUDA events, GPU idle before
the steps, the engine thread's host time by part), the medians of the decode steps and the event loop's
lag. `benchmarks/serve_bench_gpu.sh` writes one trace per served configuration (``TRACE=1``).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvstrata.engine.trace import format_timeline, read_trace, summarize


def main(paths: list[str]) -> int:
    if not paths:
        print(__doc__)
        return 2
    for path in paths:
        print(f"## {path}\n")
        with Path(path).open(encoding="utf-8") as f:
            print(format_timeline(summarize(read_trace(f))))
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
