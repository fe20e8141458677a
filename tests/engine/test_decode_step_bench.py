"""`benchmarks/decode_step_gpu.py` on the CPU (tiny geometry): the overlapped loop (the engine's CUDA
default: step N+1 launched before step N's ids are read back) gives the same greedy tokens as the loop
that reads every step back, with BF16 and fp8 history, and every run reports a step time and a plan."""

from __future__ import annotations

import json

from bench_scripts import run_benchmark


def test_overlapped_loop_gives_the_sync_loop_tokens(tmp_path) -> None:
    out = tmp_path / "step.json"
    run_benchmark(
        "decode_step_gpu.py", "--geometry", "tiny", "--device", "cpu", "--batch", "3", "--context", "40",
        "--kv", "auto,fp8_e4m3", "--loop", "sync,overlap", "--warmup", "3", "--steps", "4",
        "--profile-steps", "2", "--json", str(out),
    )  # fmt: skip
    results = json.loads(out.read_text())["results"]
    assert [(r["kv"], r["loop"]) for r in results] == [
        ("auto", "sync"),
        ("auto", "overlap"),
        ("fp8_e4m3", "sync"),
        ("fp8_e4m3", "overlap"),
    ]
    for kv in ("auto", "fp8_e4m3"):
        sync, overlap = (r for r in results if r["kv"] == kv)
        assert sync["tokens_sha1"] == overlap["tokens_sha1"]
    assert all(r["ms_per_step"] > 0 and r["begin_step_ms"] > 0 and r["kv_bytes"] > 0 for r in results)
