"""The drift fallback raises precision per layer: a forced fp4 window-0 run, served with the drift monitor
re-scoring every request, on a tiny Qwen2-style model with Qwen2.5's real outlier (a large key bias on
the lowest-frequency RoPE channels of layer 0, `kvstrata.eval.outliers.plant_key_offsets`): fp4 keys lose
that layer's key variation, int4 keys (the raised pool's) keep it.

``drift_max_level=0``: no window step, so level 1 is the precision raise alone and the BF16 window
stays 0; whatever brings the drift down is the raised pool.
"""

from __future__ import annotations

import pytest

from kvstrata.engine.drift import DriftSample
from kvstrata.engine.engine import Engine

THRESHOLD = 0.02  # KL (nats/token); measured: fp4 0.07-0.22 per request, the raised pool 0.001-0.004
GREEDY = {"temperature": 0, "max_new_tokens": 12, "ignore_eos": True}
PAGES = 3  # full pages each request writes: 48 prompt + 12 generated tokens


@pytest.fixture(scope="module")
def offset_model(tmp_path_factory: pytest.TempPathFactory):
    from kvstrata.engine.loader import load_model
    from kvstrata.eval.corpus import read_corpus
    from kvstrata.eval.outliers import build_tiny_outlier_model

    root = tmp_path_factory.mktemp("raise_model")
    path = build_tiny_outlier_model(
        root / "offset", read_corpus(None), scale=1.0, key_offset=30.0, offset_layers=(0,), rope_theta=1e6
    )
    return load_model(path)


@pytest.fixture(scope="module")
def prompts(offset_model) -> list[list[int]]:
    from kvstrata.resources import load_corpus_text

    paras = [p for p in load_corpus_text().split("\n\n") if len(p) > 400][:30]
    return [offset_model.tokenizer.encode(p)[:48] for p in paras]


def test_forced_fp4_window0_raises_precision_and_recovers(offset_model, prompts):
    from kvstrata.server.engine_client import EngineClient

    eng = Engine(
        model=offset_model, kv_cache_dtype="fp4_e2m1", recent_window=0, sinks=False, kv_plan="off",
        max_total_tokens=4096, drift_sample_rate=1.0, drift_threshold=THRESHOLD, drift_metric="kl",
        drift_max_level=0, drift_ewma_alpha=0.5, drift_cooldown=3,
    )  # fmt: skip
    samples: list[DriftSample] = []
    eng.subscribe(lambda e: samples.append(e) if isinstance(e, DriftSample) else None)
    used = [(0, 0)]  # (text pool, raised pool) pages in use, before and after each request
    views = {}  # /v1/cache while raised
    try:
        layers = offset_model.config.num_layers
        assert eng.raised_codecs() == ["int4/fp8_e4m3"] * layers  # fp4's auto raise: int4 keys, fp8 values
        assert eng.get_server_info()["max_recent_window"] == 0  # no window step: level 1 is the raise alone
        for ids in prompts:
            eng.generate(input_ids=ids, sampling_params=GREEDY)
            assert eng.wait_drift_idle(60)
            tiers = eng.cache_stats().tiers  # one engine-loop pass: a pending level change is applied first
            used.append((tiers["cold"].used, tiers["raised"].used))
            if eng.cache.raised and not views:
                views = EngineClient(eng).snapshot().cache_json()
            if any(a.level > b.level for a, b in zip(samples, samples[1:], strict=False)):
                break  # came back down
        stats = eng.get_stats().drift
        eng.cache.check_invariants()
        raised_total = eng.cache.raised_pool.allocator.total
    finally:
        eng.shutdown()
    levels = [s.level for s in samples]
    up = levels.index(1)
    assert up < 20  # the monitor raised precision within 20 sampled requests
    assert min(s.kl for s in samples[: up + 1]) > THRESHOLD  # fp4 keys at window 0 drift
    down = levels.index(0, up)
    raised = samples[up + 1 : down + 1]  # requests served while raised (each sample follows its request)
    assert len(raised) >= 3 and max(s.kl for s in raised) < THRESHOLD / 2  # the raise repairs the drift
    assert min(s.ewma for s in raised) < THRESHOLD / 2  # the served drift fell below the threshold
    assert stats.level_changes == 2 and not stats.raised and stats.level == 0  # hysteresis: back down
    # every request wrote its pages in the pool of the level it was served at; written pages stayed put
    served_at = [0, *levels[:-1]]
    for level, before, after in zip(served_at, used[:-1], used[1:], strict=True):
        grew = (after[0] - before[0], after[1] - before[1])
        assert grew == ((0, PAGES) if level else (PAGES, 0)), (level, before, after)
    assert views["kv_raise"]["raised"] is True
    assert views["kv_raise"]["raised_codecs"][0] == {"layer": 0, "k": "int4", "v": "fp8_e4m3"}
    assert views["kv_raise"]["pages_in_use"] == {"cold": used[up + 1][0], "raised": 0}
    assert views["layer_codecs"][0] == {"layer": 0, "k": "int4", "v": "fp8_e4m3"}  # what new pages get
    assert views["tiers"]["raised"]["total_pages"] == raised_total > 0
