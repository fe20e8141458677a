"""Forced drift: FP4 history with no BF16 window, every request re-scored, a low KL threshold.

A story continuation reads most of its history from FP4 pages; greedy decoding makes its drift
deterministic, so the smoothed KL(reference || served) passes the threshold and the fallback level
goes up. Then the traffic turns to requests short enough to live entirely in the BF16 ring
(prompt + output < one page): their KL is ~1e-5, the EWMA decays below half the threshold, and the
level steps back down (hysteresis: a few consecutive low samples per step).

Why the KL metric here and not the default ``|ppl ratio - 1|``: over a few dozen tokens the
perplexity ratio is noise-dominated and not sign-definite (the served model chose the tokens, so a
damaged distribution can make them *more* likely under itself). Measured on the default model:
this prompt's fp4 ratio - 1 was -0.005 on one machine, +0.0016 on another, and moved from -0.003 to
+0.0001 with the CPU thread count at 64 output tokens; ring-only requests gave |ratio - 1| up to
0.003 (BF16 ring vs the float32 reference). The KL of the same runs: 0.0154-0.0155 for the story at
64 tokens with either thread count, 0.8e-5 to 1.3e-5 for ring-only requests: three orders of
magnitude apart, so the threshold sits with a 3x margin on each side.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from .live import LiveServer, live_server

THRESHOLD = 0.005  # mean KL; the story's fp4 KL is ~0.0155 at 64 tokens, a ring-only request's ~1e-5
STORY_TOKENS = 64
STORY = "Once upon a time, in a small village by the sea, there lived"


@pytest.fixture(scope="module")
def drift_server() -> Iterator[LiveServer]:
    from kvstrata import Engine

    engine = Engine(
        kv_cache_dtype="fp4_e2m1",
        recent_window=0,
        drift_sample_rate=1.0,
        drift_threshold=THRESHOLD,
        drift_metric="kl",
        seed=0,
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
    # the gauge is 1 + the smoothed drift (here the KL): 1.0 = no drift; fallback above 1 + threshold
    assert m["kvstrata:fallback_level"] == 0 and m["kvstrata:ppl_drift_ewma"] == 1.0

    ewmas: list[float] = []
    levels: list[float] = []
    for _ in range(4):  # 15 + 64 tokens: four pages of FP4 history
        m = complete(drift_server, STORY, STORY_TOKENS)
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
