"""`PinTable`: named pins survive eviction pressure, the budget refuses (counted), TTL expires."""

from __future__ import annotations

import pytest
from radix_helpers import TokenKV, run_step, small_cache

from kvstrata.radix import PinBudgetExceeded

DATA = TokenKV(kv_heads=2, q_heads=4, head_dim=8)


def prefill(cache, tokens):
    seq = cache.admit(tokens)
    run_step(cache, [seq], [len(tokens) - seq.length], DATA, 8**-0.5)
    cache.finish(seq)
    cache.check_invariants()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_pinned_prefix_survives_eviction_pressure_until_unpinned():
    cache = small_cache(num_pages=16)
    pinned = list(range(1000, 1013))  # 3 full pages + 1 token
    prefill(cache, pinned)
    pin = cache.pins.pin(pinned, kind="image", label="abc", ttl_s=None)
    assert (pin.tokens, cache.tree.pinned_pages, cache.pins.pinned_bytes) == (
        12,
        3,
        3 * cache.pool.page_bytes,
    )
    for i in range(12):  # 12 prompts of 4 pages each through a 16-page pool: constant eviction
        prefill(cache, [i * 100 + t for t in range(17)])
        assert cache.match_prefix(pinned).tokens == 12
    assert cache.evicted_pages > 0
    unpinned = cache.tree.total_pages - 3
    assert unpinned > 0 and cache.evict(100) == unpinned  # everything but the pin goes
    assert cache.match_prefix(pinned).tokens == 12
    assert cache.pins.pin(pinned) is pin  # the same prefix again: the same pin, not a second one
    assert cache.pins.created == 1
    cache.pins.unpin(pin.pin_id)
    assert cache.tree.pinned_pages == 0 and cache.evict(100) == 3
    cache.check_invariants()
    with pytest.raises(KeyError):
        cache.pins.unpin(pin.pin_id)


def test_budget_refusal_is_counted_and_changes_nothing():
    cache = small_cache(num_pages=16, pin_budget_bytes=None)
    cache.pin_budget_bytes = 3 * cache.pool.page_bytes
    prefill(cache, list(range(8)))
    prefill(cache, list(range(50, 58)))
    cache.pins.pin(list(range(8)))
    with pytest.raises(PinBudgetExceeded, match="over the pin budget of 3072 bytes"):
        cache.pins.pin(list(range(50, 58)))
    assert (cache.pins.refused, cache.pins.created, len(cache.pins.pins), cache.tree.pinned_pages) == (
        1,
        1,
        1,
        2,
    )
    with pytest.raises(ValueError, match="only 0 of the prefix's 8 tokens are cached"):
        cache.pins.pin(list(range(200, 208)))
    with pytest.raises(ValueError, match="at least one full page"):
        cache.pins.pin([1, 2, 3])
    stats = cache.stats()
    assert (stats.pins_created, stats.pins_refused, stats.pinned_bytes) == (1, 1, 2 * cache.pool.page_bytes)
    assert [p["tokens"] for p in stats.pins] == [8]
    cache.check_invariants()


def test_ttl_expiry_releases_the_pin():
    cache = small_cache(num_pages=16)
    cache.pins.clock = clock = Clock()
    prefill(cache, list(range(9)))
    prefill(cache, list(range(300, 309)))
    short = cache.pins.pin(list(range(9)), ttl_s=5.0)
    long = cache.pins.pin(list(range(300, 309)), ttl_s=50.0)
    clock.now += 4.0
    assert cache.pins.expire() == 0 and cache.pins.to_json()[0]["ttl_s"] == 1.0
    assert cache.pins.pin(list(range(9)), ttl_s=10.0) is short  # pinning again extends the expiry
    clock.now += 9.0
    assert cache.pins.expire() == 0
    clock.now += 1.5
    assert cache.pins.expire() == 1 and cache.pins.expired == 1
    assert list(cache.pins.pins) == [long.pin_id]
    assert cache.tree.pinned_pages == 2
    cache.check_invariants()
    cache.reset()
    assert cache.pins.pins == {} and cache.tree.pinned_pages == 0
