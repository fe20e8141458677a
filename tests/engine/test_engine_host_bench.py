"""`benchmarks/engine_host.py` on a small batch: it times the engine thread's plan and read-back of each
decode step, for this code and for a baseline checkout (here the same one) in a subprocess."""

from __future__ import annotations

import json

import pytest
from bench_scripts import ROOT, run_benchmark

SMALL = ("--batch", "8", "--prompt", "20", "--new", "6", "--repeats", "1")


@pytest.mark.parametrize("mode", [(), ("--stream",)], ids=["collected", "streamed"])
def test_engine_host_times_both_parts(mode: tuple[str, ...]) -> None:
    parts = json.loads(run_benchmark("engine_host.py", *SMALL, *mode, "--json").splitlines()[-1])
    assert set(parts) == {"plan", "post"}
    assert all(0 < ms < 1000 for ms in parts.values())


def test_engine_host_compares_with_a_baseline() -> None:
    table = run_benchmark("engine_host.py", *SMALL, "--baseline", str(ROOT)).splitlines()
    rows = [line.split("|")[1:-1] for line in table if line.startswith(("| plan", "| post"))]
    assert [cells[0].strip() for cells in rows] == ["plan", "post"]
    assert all(cells[-1].strip().endswith("x") and float(cells[-1].strip()[:-1]) > 0 for cells in rows)
