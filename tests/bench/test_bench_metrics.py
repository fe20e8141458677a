"""The benchmark's statistics against values computed by hand, and its arrival process."""

from __future__ import annotations

import math

import pytest

from kvstrata.bench.metrics import RequestResult, compute_metrics
from kvstrata.bench.runner import arrival_gaps


def _results() -> list[RequestResult]:
    return [
        RequestResult(True, prompt_len=10, output_len=4, ttft=0.1, itl=[0.02, 0.03, 0.05], latency=0.2),
        RequestResult(True, prompt_len=20, output_len=2, ttft=0.3, itl=[0.1], latency=0.4),
        RequestResult(False, prompt_len=30, error="HTTP 400: bad"),
    ]


def test_metrics_equal_hand_computed_values() -> None:
    m = compute_metrics(_results(), duration=2.0)
    expected = {
        "completed": 2,
        "errors": 1,
        "total_input_tokens": 30,  # the failed request's 30 tokens do not count
        "total_output_tokens": 6,
        "request_throughput": 1.0,
        "input_throughput": 15.0,
        "output_throughput": 3.0,
        "total_throughput": 18.0,
        "concurrency": 0.3,  # (0.2 + 0.4) s of requests over 2 s
        "mean_ttft_ms": 200.0,
        "median_ttft_ms": 200.0,
        "std_ttft_ms": 100.0,
        "p99_ttft_ms": 298.0,  # 100 + 0.99 * (300 - 100)
        # pooled gaps [20, 30, 50, 100] ms
        "mean_itl_ms": 50.0,
        "median_itl_ms": 40.0,
        "p95_itl_ms": 92.5,  # rank 0.95 * 3 = 2.85: 50 + 0.85 * 50
        "p99_itl_ms": 98.5,  # rank 2.97: 50 + 0.97 * 50
        "mean_e2e_latency_ms": 300.0,
        "median_e2e_latency_ms": 300.0,
        "p99_e2e_latency_ms": 398.0,
        # TPOT: (200 - 100) / 3 and (400 - 300) / 1
        "mean_tpot_ms": (100 / 3 + 100) / 2,
        "median_tpot_ms": (100 / 3 + 100) / 2,
    }
    for key, value in expected.items():
        assert m[key] == pytest.approx(value, rel=1e-12, abs=1e-9), key
    assert m["duration"] == 2.0


def test_metrics_of_a_run_without_successes_are_zero() -> None:
    m = compute_metrics([RequestResult(False, error="x")] * 3, duration=1.5)
    assert m["completed"] == 0 and m["errors"] == 3
    assert m["output_throughput"] == 0.0 and m["median_itl_ms"] == 0.0 and m["p99_ttft_ms"] == 0.0


def test_metrics_reject_a_zero_duration() -> None:
    with pytest.raises(ValueError, match="duration"):
        compute_metrics(_results(), duration=0.0)


def test_arrival_gaps_are_seeded_exponential_or_zero() -> None:
    assert arrival_gaps(5, math.inf, seed=3) == [0.0] * 5
    gaps = arrival_gaps(20_000, 4.0, seed=3)
    assert gaps == arrival_gaps(20_000, 4.0, seed=3)
    assert gaps != arrival_gaps(20_000, 4.0, seed=4)
    assert min(gaps) > 0
    mean = sum(gaps) / len(gaps)
    assert mean == pytest.approx(0.25, rel=0.03)  # mean gap 1 / rate; standard error 0.7%
    # exponential: P(gap > mean) = e^-1
    assert sum(g > 0.25 for g in gaps) / len(gaps) == pytest.approx(math.exp(-1), abs=0.015)
    with pytest.raises(ValueError, match="request-rate"):
        arrival_gaps(3, 0.0, seed=1)
