"""`benchmarks/prefill_gpu.py` on the CPU (tiny geometry): every part runs (the dense forward, the engine
step variants with their profiles, one offline engine run) and reports its figures."""

from __future__ import annotations

import json

from bench_scripts import run_benchmark


def test_prefill_benchmark_runs_every_part(tmp_path) -> None:
    out = tmp_path / "prefill.json"
    run_benchmark(
        "prefill_gpu.py", "--geometry", "tiny", "--device", "cpu", "--kv", "fp8_e4m3", "--input-len", "40",
        "--chunk", "96", "--decodes", "3", "--steps", "1", "--profile-steps", "1", "--prompts", "3",
        "--new", "2", "--policy", "prefill", "--profile-engine", "--json", str(out),
    )  # fmt: skip
    result = json.loads(out.read_text())
    steps = result["steps"]
    assert steps[0]["what"].startswith("dense forward")
    assert any(s["what"].startswith("engine step, mixed") for s in steps)
    for s in steps:
        assert s["s_per_step"] > 0 and s["profile"], s["what"]
        assert s["tokens_per_step"] >= s["prompt_tokens_per_step"] == 2 * 40
    (engine,) = result["engines"]
    assert engine["prompts"] == 3 and engine["prompt_tokens"] == 3 * 40 and engine["steps"] > 0
    # --profile-engine: one profiler window over the whole run (on the CPU: no kernel records)
    assert engine["profile"]["wall_ms_per_step"] > 0 and engine["profile"]["busy_ms_per_step"] >= 0
