"""EngineClient.snapshot: /v1/cache and /metrics report what the cache does, not what was asked of it."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from kvstrata.engine.drift import DriftStats
from kvstrata.engine.stats import EngineStats
from kvstrata.radix.stats import CacheStats, TierStats
from kvstrata.server.engine_client import EngineClient


class RecordedEngine:
    """The engine surface EngineClient reads, holding fixed stats objects."""

    tokenizer = list(range(100))  # len() is the vocabulary size

    def __init__(self, stats: EngineStats) -> None:
        self.stats = stats

    def get_server_info(self) -> dict[str, Any]:
        return {"model": "m", "context_length": 2048, "max_total_tokens": 4096, "recent_window": 32}

    def get_stats(self) -> EngineStats:
        return self.stats

    # What the snapshot also reads: vision counters and the per-layer codecs of a one-layer fp8 model.
    cache_config = SimpleNamespace(page_size=16)
    config = SimpleNamespace(kv_heads=2, head_dim=64)
    core = SimpleNamespace(kv_plan=None)

    def vision_stats(self) -> dict[str, int]:
        return {"encoded_images": 0, "cached_images": 0}

    def layer_codecs(self) -> list[str]:
        return ["fp8_e4m3"]

    def raised_codecs(self) -> list[str]:
        return []


def cache_stats(window: int, used: int, cached: int, evictable: int) -> CacheStats:
    cold = TierStats("cold", 1000, total=100, free=100 - used, used=used, cached=cached, evictable=evictable)
    ring = TierStats("ring", 500, total=8, free=8, used=0)
    return CacheStats(
        tiers={"cold": cold, "ring": ring},
        running=0,
        quantized_pages=0,
        evicted_pages=0,
        pinned_pages=0,
        matched_tokens=0,
        missed_tokens=0,
        quantized_elements=0,
        recent_window=window,
    )


def test_cache_reports_the_window_in_use_not_the_one_the_monitor_asks_for() -> None:
    """Between the drift worker raising its level and the engine thread applying it, the monitor
    asks for 128 tokens while the cache still uses 32: /v1/cache reports the cache's 32."""
    drift = DriftStats(enabled=True, level=2, window=128, ewma=0.2, samples=3, dropped=0, level_changes=2)
    stats = EngineStats(drift=drift, cache=cache_stats(window=32, used=10, cached=6, evictable=6))
    body = EngineClient(RecordedEngine(stats)).snapshot().cache_json()
    assert body["recent_window"] == 32
    assert body["drift"]["window"] == 128 and body["fallback_level"] == 2
