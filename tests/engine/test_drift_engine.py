"""The accuracy monitor inside the engine: forced drift raises the fallback level, recovery lowers it.

fp4 history with a window of 0 and no sinks drifts on purpose (KL ~0.005-0.015 per request on
30-token prompts); at level 2 (window 32) such short sequences stay entirely in the ring, KL drops
to ~0 and, with a cooldown of one sample, the level comes back down. The precision raise is off here
(``drift_raise_dtype="off"``): this is the window-only fallback (tests/engine/test_drift_raise.py raises).
"""

from __future__ import annotations

import pytest

from kvstrata.engine.drift import DriftSample
from kvstrata.engine.engine import Engine


@pytest.fixture(scope="module")
def prompts(default_model):
    from kvstrata.resources import load_corpus_text

    paras = [p for p in load_corpus_text().split("\n\n") if len(p) > 400][20:28]
    return [default_model.tokenizer.encode(p)[:30] for p in paras]


def test_forced_drift_raises_and_recovery_lowers_level(default_model, prompts):
    eng = Engine(
        model=default_model, kv_cache_dtype="fp4_e2m1", recent_window=0, sinks=False, max_total_tokens=2048,
        drift_sample_rate=1.0, drift_threshold=0.004, drift_metric="kl", drift_max_level=2,
        drift_ewma_alpha=1.0, drift_cooldown=1, drift_raise_dtype="off",
    )  # fmt: skip
    samples: list[DriftSample] = []
    eng.subscribe(lambda e: samples.append(e) if isinstance(e, DriftSample) else None)
    windows = []
    try:
        assert eng.get_server_info()["max_recent_window"] == 32  # sized for the top level: 0, 16, 32
        for ids in prompts:
            eng.generate(
                input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
            )
            assert eng.wait_drift_idle(60)
            eng.cache_stats()  # one engine-loop pass: a pending window change is applied first
            windows.append(eng.cache.recent_window)
        stats = eng.get_stats().drift
    finally:
        eng.shutdown()
    levels = [s.level for s in samples]
    assert len(samples) == len(prompts) == stats.samples
    assert levels[0] == 1 and samples[0].kl > 0.004  # fp4 at window 0 drifts
    assert max(levels) == 2
    ups = sum(b > a for a, b in zip([0, *levels], levels, strict=False))
    downs = sum(b < a for a, b in zip([0, *levels], levels, strict=False))
    assert ups >= 2 and downs >= 1 and stats.level_changes == ups + downs
    assert min(s.kl for s in samples if s.level < max(levels)) < 0.002  # level 2 runs fully in the ring
    assert windows == [{0: 0, 1: 16, 2: 32}[lvl] for lvl in levels]
    assert stats.kls == pytest.approx([s.kl for s in samples])
    assert len(stats.ppl_ratios) == len(samples)
