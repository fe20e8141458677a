"""`CacheStats`: a plain snapshot of the cache's tiers and counters (the server exports it)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TierStats:
    """One tier counted in pages of ``page_size`` tokens; ``unit_bytes`` is one page's bytes.

    ``used`` = ``cached`` (held by the tree) + pages held only by running sequences; ``pinned`` is
    the part of ``cached`` under a pin; ``evictable`` the part of ``cached`` that no running
    sequence locks and no pin protects: admission may take it back at once, so ``usage`` counts
    it as available (SGLang's ``token_usage``). The ring counts a slot as ``ring_tokens /
    page_size`` pages.
    """

    name: str
    unit_bytes: int
    total: int
    free: int
    used: int
    cached: int = 0
    pinned: int = 0
    bytes_per_token: float = 0.0
    evictable: int = 0

    def pages(self, state: str) -> int:
        return int(getattr(self, state))

    def bytes(self, state: str) -> int:
        return self.pages(state) * self.unit_bytes

    @property
    def usage(self) -> float:
        """Share of the tier that is neither free nor evictable."""
        return (self.used - self.evictable) / self.total if self.total else 0.0


@dataclass(frozen=True)
class CacheStats:
    tiers: dict[str, TierStats]
    running: int
    quantized_pages: int
    evicted_pages: int
    pinned_pages: int
    matched_tokens: int
    missed_tokens: int
    quantized_elements: int  # per layer and kind: the denominator of the overflow ratio
    recent_window: int = 0  # the BF16 window new steps use now (after any precision fallback)
    overflow_k: list[int] = field(default_factory=list)
    overflow_v: list[int] = field(default_factory=list)
    nonfinite_k: list[int] = field(default_factory=list)
    nonfinite_v: list[int] = field(default_factory=list)
    absmax_k: list[float] = field(default_factory=list)  # running max |x| written, per layer
    absmax_v: list[float] = field(default_factory=list)
    absmax_ratio_k: list[float] = field(default_factory=list)  # absmax / calibration clip (static scales)
    absmax_ratio_v: list[float] = field(default_factory=list)
    pinned_bytes: int = 0
    pin_budget_bytes: int = 0
    pins_created: int = 0
    pins_expired: int = 0
    pins_refused: int = 0
    pins: list[dict] = field(default_factory=list)  # `PinTable.to_json()`: id, kind, tokens, bytes, ttl

    @property
    def cache_hit_rate(self) -> float:
        seen = self.matched_tokens + self.missed_tokens
        return self.matched_tokens / seen if seen else 0.0

    def bytes_per_token(self) -> dict[str, float]:
        return {name: tier.bytes_per_token for name, tier in self.tiers.items()}
