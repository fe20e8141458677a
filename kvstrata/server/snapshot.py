"""Plain-data snapshot of the engine's state, the one shape that /metrics and /v1/cache read.

``EngineSnapshot`` is filled by ``kvstrata.server.engine_client.EngineClient.snapshot()`` from the
engine's stats objects at scrape time; nothing here imports the engine or Prometheus.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

TIERS = ("cold", "ring")
PAGE_STATES = ("free", "used", "cached", "pinned", "evictable")


@dataclass
class TierSnapshot:
    pages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PAGE_STATES, 0))
    bytes: dict[str, int] = field(default_factory=lambda: dict.fromkeys(PAGE_STATES, 0))
    total_pages: int = 0
    total_bytes: int = 0
    bytes_per_token: float = 0.0
    usage: float = 0.0  # 0..1: share of the tier neither free nor evictable (SGLang token_usage)


@dataclass
class DriftSnapshot:
    drift_ewma: float = (
        0.0  # the engine's EWMA of (perplexity ratio - 1): what the threshold is compared with
    )
    level: int = 0
    threshold: float = 0.0
    window: int = 0  # BF16 window the level asks for
    samples: int = 0  # requests re-scored so far
    level_changes: int = 0
    raised: bool = False  # new text pages go to the raised pool's wider codecs


@dataclass
class EngineSnapshot:
    num_running: int = 0
    num_queued: int = 0
    requests_received: int = 0
    requests_finished: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    generation_tokens: int = 0
    cached_tokens: int = 0
    tiers: dict[str, TierSnapshot] = field(default_factory=lambda: {t: TierSnapshot() for t in TIERS})
    cache_hit_rate: float = 0.0
    gen_throughput: float = 0.0
    quantized_pages: int = 0
    evicted_pages: int = 0
    pinned_pages: int = 0
    tree_pages: int = 0  # pages held by the radix tree
    in_use_pages: int = 0  # pages not free
    overflow_ratio: dict[tuple[int, str], float] = field(default_factory=dict)
    nonfinite: dict[tuple[int, str], int] = field(default_factory=dict)
    absmax_ratio: dict[tuple[int, str], float] = field(default_factory=dict)
    drift: DriftSnapshot = field(default_factory=DriftSnapshot)
    recent_window: int = 0
    pinned_bytes: int = 0
    pin_budget_bytes: int = 0
    pins_created: int = 0
    pins_expired: int = 0
    pins_refused: int = 0
    pins: list[dict[str, Any]] = field(default_factory=list)
    vision_encoded_images: int = 0  # vision tower runs (per image)
    vision_cached_images: int = 0  # images whose span was cached: tower skipped
    # Per layer: (key codec, value codec) of new cold pages, and the load-time plan that chose them
    layer_codecs: list[tuple[str, str]] = field(default_factory=list)
    layer_bits: list[tuple[int, int]] = field(default_factory=list)  # stored bits per element, K and V
    kv_plan: dict[str, Any] | None = None
    # The drift fallback's raised pool: its per-layer (key codec, value codec); empty without one
    raised_codecs: list[tuple[str, str]] = field(default_factory=list)
    preemptions: int = 0  # running requests preempted (pages returned, recomputed later)
    nonfinite_logits: int = 0  # requests ended because their logits held NaN/Inf

    @property
    def ppl_drift_ewma(self) -> float:
        """Smoothed perplexity ratio, 1 + EWMA(ratio - 1) (= EWMA of the ratio): 1.0 means no drift,
        and fallback starts above 1 + drift_threshold. Exported as ``kvstrata:ppl_drift_ewma``."""
        return 1.0 + self.drift.drift_ewma

    def cache_json(self) -> dict[str, Any]:
        """The body of GET /v1/cache."""
        return {
            "tiers": {name: asdict(tier) for name, tier in self.tiers.items()},
            "pages_in_use": self.in_use_pages,
            "pages_in_tree": self.tree_pages,
            "pinned_pages": self.pinned_pages,
            "pinned_bytes": self.pinned_bytes,
            "pin_budget_bytes": self.pin_budget_bytes,
            "pins": self.pins,
            "vision": {
                "encoded_images": self.vision_encoded_images,
                "cached_images": self.vision_cached_images,
            },
            "quantized_pages": self.quantized_pages,
            "evicted_pages": self.evicted_pages,
            "hit_rate": self.cache_hit_rate,
            "num_running_reqs": self.num_running,
            "num_queue_reqs": self.num_queued,
            "recent_window": self.recent_window,
            "fallback_level": self.drift.level,
            "ppl_drift_ewma": self.ppl_drift_ewma,
            "drift": asdict(self.drift),
            "layer_codecs": [{"layer": i, "k": k, "v": v} for i, (k, v) in enumerate(self.layer_codecs)],
            "kv_plan": self.kv_plan,
            "kv_raise": self._raise_json(),
        }

    def _raise_json(self) -> dict[str, Any] | None:
        """The drift fallback's precision raise: on or off, the raised pool's codecs, and pages in use
        per pool (new text pages go to "raised" while it is on; written pages keep their pool)."""
        if not self.raised_codecs:
            return None
        return {
            "raised": self.drift.raised,
            "raised_codecs": [{"layer": i, "k": k, "v": v} for i, (k, v) in enumerate(self.raised_codecs)],
            "pages_in_use": {
                name: self.tiers[name].pages["used"] for name in ("cold", "raised") if name in self.tiers
            },
        }
