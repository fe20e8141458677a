"""Forced drift: FP4 history with no BF16 window, every request re-scored, a low threshold.

A story continuation reads most of its history from FP4 pages; greedy decoding makes its drift
deterministic (about +0.005 with this engine's fp4 layout: the served model is less sure of the same
tokens), so the smoothed drift passes the threshold and the fallback level goes up. Then the traffic turns to
requests short enough to live entirely in the BF16 ring (prompt + output < one page): their drift
is ~0, the EWMA decays below half the threshold, and the level steps back down (hysteresis: a few
consecutive low samples per step).

Why one fixed prompt: the engine's drift is ppl(served)/ppl(reference) - 1 over tokens the served
model chose itself, which is not sign-definite (on tokens where the quantized model picked its own
peak, the reference is *less* sure, and the ratio drops below 1). Many prompts give drift < 0 at
these bit widths; this one gives drift > 0 for int4 and fp4 alike.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .live import LiveServer, live_server

THRESHOLD = 0.004  # below this prompt's deterministic fp4 drift (+0.00505 since fp4's BF16 globals)
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def drift_server() -> Iterator[LiveServer]:
    from kvstrata import Engine

    engine = Engine(
        kv_cache_dtype="fp4_e2m1", recent_window=0, drift_sample_rate=1.0, drift_threshold=THRESHOLD, seed=0
    )
    try:
        with live_server(engine) as srv:
            yield srv
    finally:
        engine.shutdown()


def gauges(server: LiveServer) -> dict[str, float]:
    with server.client() as c:
        text = c.get("/metrics").text
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.labels:
                out[s.name] = s.value
    return out


def complete(server: LiveServer, prompt: str, max_tokens: int) -> dict[str, float]:
    """One request; returns the metrics once its re-score has been recorded."""
    before = gauges(server)["kvstrata:ppl_drift_ratio_count"]
    with server.client() as c:
        body = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    deadline = time.monotonic() + 60
    while True:
        m = gauges(server)
        if m["kvstrata:ppl_drift_ratio_count"] > before:
            return m
        assert time.monotonic() < deadline, "the drift monitor did not re-score the request"
        time.sleep(0.1)


def test_drift_raises_fallback_and_recovers(drift_server: LiveServer, caplog: Any) -> None:
    caplog.set_level(logging.WARNING, logger="kvstrata.drift")
    m = gauges(drift_server)
    # the gauge is the smoothed ratio: 1.0 = no drift; fallback starts above 1 + threshold
    assert m["kvstrata:fallback_level"] == 0 and m["kvstrata:ppl_drift_ewma"] == 1.0

    ewmas: list[float] = []
    levels: list[float] = []
    for _ in range(4):  # 15 + 24 tokens: two pages of FP4 history
        m = complete(drift_server, STORY, 24)
        ewmas.append(m["kvstrata:ppl_drift_ewma"] - 1.0)
        levels.append(m["kvstrata:fallback_level"])
        if levels[-1] >= 1:
            break
    print(f"\nforced drift: ewma - 1 {[round(e, 4) for e in ewmas]}, levels {levels}")
    assert max(ewmas) > THRESHOLD
    assert levels[-1] >= 1
    peak = max(levels)

    low: list[float] = []
    for i in range(30):  # short requests: all of it in the BF16 ring
        m = complete(drift_server, f"Item {i}: yes", 8)
        low.append(m["kvstrata:ppl_drift_ewma"] - 1.0)
        if m["kvstrata:fallback_level"] == 0:
            break
    print(f"recovery: ewma - 1 {[round(e, 4) for e in low]}, final level {m['kvstrata:fallback_level']}")
    assert m["kvstrata:fallback_level"] == 0
    assert low[-1] < THRESHOLD / 2
    assert m["kvstrata:ppl_drift_ratio_count"] == len(ewmas) + len(low)
    assert m["kvstrata:kl_divergence_count"] == len(ewmas) + len(low)
    assert m["kvstrata:kl_divergence_sum"] > 0
    changes = [r.getMessage() for r in caplog.records if "fallback level" in r.getMessage()]
    assert any("level 0 -> 1" in c for c in changes), changes
    assert any(f"level {int(peak)} -> {int(peak) - 1}" in c for c in changes) or peak == 0, changes
    with drift_server.client() as c:
        cache = c.get("/v1/cache").json()
    assert cache["fallback_level"] == 0
    assert cache["ppl_drift_ewma"] == pytest.approx(1.0 + low[-1], abs=1e-9)
    assert cache["drift"]["threshold"] == THRESHOLD and cache["drift"]["level_changes"] >= 2
