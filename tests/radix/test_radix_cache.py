"""Prefix sharing, exhaustion, pinning, eviction order, accounting and misuse of the cache."""

from __future__ import annotations

import math

import pytest
import torch
from radix_helpers import TokenKV, run_step, small_cache

from kvstrata.quant import get_codec
from kvstrata.radix import (
    CacheConfig,
    OutOfPages,
    OutOfSlots,
    PinBudgetExceeded,
    StratifiedKVCache,
)
from kvstrata.radix.pool import cold_page_bytes

P = 4
SCALE = 1 / math.sqrt(8)
DATA = TokenKV(2, 4, 8)


def prefill(cache: StratifiedKVCache, tokens: list[int], extra_key=None):
    seq = cache.admit(tokens, extra_key)
    run_step(cache, [seq], [len(tokens) - seq.length], DATA, SCALE)
    cache.check_invariants()
    return seq


def snapshot(cache: StratifiedKVCache) -> tuple:
    return (
        sorted(cache.pool.allocator.free_ids()),
        cache.ring.slots.free_ids(),
        [(tuple(n.pages), n.lock_ref, n.pin_ref, n.last_access) for n in cache.tree.nodes()],
        [(s.length, tuple(s.page_ids)) for s in cache.running.values()],
        cache.stats(),
    )


def test_common_prefix_is_stored_once_and_a_mid_page_divergence_splits_the_node() -> None:
    cache = small_cache(num_pages=64)
    common = [7] * 3 + list(range(37))  # 40 tokens: 10 pages
    a = prefill(cache, common + [1, 2, 3, 4, 5])
    b = prefill(cache, common + [9, 9, 9, 9, 9, 9])
    assert b.cached_tokens == 0  # a is still running: nothing is in the tree yet
    cache.finish(a)
    used_after_a = cache.stats().tiers["cold"].used
    assert used_after_a == 11 + 11  # a's 11 pages in the tree, b's 11 private
    cache.finish(b)
    cache.check_invariants()
    # b's copy of the 10 common pages was freed: stored once.
    assert cache.stats().tiers["cold"].used == 10 + 1 + 1
    assert cache.tree.total_pages == 12
    (root,) = cache.tree.roots().values()
    (trunk,) = root.children.values()
    assert len(trunk.pages) == 10 and len(trunk.children) == 2

    trunk_pages = list(trunk.pages)
    c = prefill(cache, common[:22] + [5, 5, 5, 5, 5, 5, 5, 5])  # diverges inside page 5 (tokens 20..23)
    assert c.cached_tokens == 20 and c.page_ids[:5] == trunk_pages[:5]
    cache.finish(c)
    cache.check_invariants()
    (upper,) = root.children.values()
    assert len(upper.pages) == 5 and len(upper.tokens) == 20
    assert {len(n.pages) for n in upper.children.values()} == {5, 2}  # old lower half, c's 2 pages
    assert upper.children[tuple(common[20:24])] is trunk and len(trunk.pages) == 5
    assert cache.match_prefix(common + [1, 2, 3, 4]).tokens == 44
    assert cache.match_prefix(common[:22] + [5, 5, 5, 5, 5, 5]).tokens == 28
    stats = cache.stats()
    assert stats.matched_tokens == 20 and stats.missed_tokens == 45 + 46 + 10
    assert stats.tiers["cold"].cached == 14


def test_running_sequences_share_a_prefix_through_cache_prefix() -> None:
    cache = small_cache(num_pages=64)
    prompt = list(range(50, 70))  # 5 pages
    a = prefill(cache, prompt + [1])
    cache.cache_prefix(a)
    b = prefill(cache, prompt + [2])
    assert b.cached_tokens == 20 and b.page_ids == a.page_ids
    assert cache.stats().tiers["cold"].used == 5
    a.token_ids += [5, 6, 7]
    b.token_ids += [5, 6, 8]
    run_step(cache, [a, b], [3, 3], DATA, SCALE)
    cache.check_invariants()
    assert cache.stats().tiers["cold"].used == 7  # each completed one private page


def test_namespaces_do_not_share_pages() -> None:
    cache = small_cache(num_pages=64)
    cache.finish(prefill(cache, list(range(9)), extra_key="image:abc"))
    assert cache.match_prefix(list(range(9))).tokens == 0
    assert cache.match_prefix(list(range(9)), "image:abc").tokens == 8
    seq = cache.admit(list(range(9)), "image:abc")
    assert seq.cached_tokens == 8


def test_exhaustion_raises_out_of_pages_and_changes_nothing() -> None:
    cache = small_cache(num_pages=6, max_running=2)
    a = prefill(cache, list(range(17)))  # 4 pages, running (locked as private)
    cache.cache_prefix(a)  # in the tree and locked by a: not evictable
    b = cache.admit([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12])
    before = snapshot(cache)
    with pytest.raises(OutOfPages, match=r"need 3 cold pages: 2 free, 0 evictable, 4 locked"):
        cache.begin_step([b], [12])
    assert snapshot(cache) == before
    cache.check_invariants()
    run_step(cache, [b], [8], DATA, SCALE)  # 2 pages still fit
    assert cache.num_free_pages == 0
    c_before = snapshot(cache)
    with pytest.raises(OutOfSlots, match="all 2 ring slots"):
        cache.admit([3, 3, 3])
    assert snapshot(cache) == c_before


def test_eviction_frees_lru_unlocked_leaves_to_make_room() -> None:
    cache = small_cache(num_pages=8, max_running=2)
    for first in (10, 20, 30):
        cache.finish(prefill(cache, [first] * 8 + [1]))  # 2 pages each
    cache.match_prefix([10] * 8)  # 10 is now the most recently used
    seq = cache.admit([40] * 13)
    run_step(cache, [seq], [12], DATA, SCALE)  # 3 pages: 2 free + evict the LRU prefix (20)
    cache.check_invariants()
    assert cache.match_prefix([20] * 8).tokens == 0
    assert cache.match_prefix([10] * 8).tokens == 8 and cache.match_prefix([30] * 8).tokens == 8
    assert cache.stats().evicted_pages == 2


def test_pins_survive_eviction_and_the_budget_is_enforced() -> None:
    cache = small_cache(num_pages=16, pin_budget_bytes=None)
    page = cache.pool.page_bytes
    cache.pin_budget_bytes = 3 * page
    cache.finish(prefill(cache, list(range(13))))  # 3 pages
    cache.finish(prefill(cache, [99] * 9))  # 2 pages
    h = cache.match_prefix(list(range(12))).handle
    cache.pin(h)
    assert cache.stats().pinned_pages == 3
    other = cache.match_prefix([99] * 8).handle
    before = snapshot(cache)
    with pytest.raises(
        PinBudgetExceeded,
        match=r"make 5120 pinned bytes, over the pin budget of 3072 bytes \(3072 pinned now\)",
    ):
        cache.pin(other)
    assert snapshot(cache) == before
    assert cache.evict(100) == 2  # only the unpinned prefix goes
    assert cache.match_prefix(list(range(12))).tokens == 12
    shorter = cache.match_prefix(list(range(8))).handle  # splits the pinned node: still pinned
    cache.pin(shorter)  # already pinned pages cost nothing
    cache.check_invariants()
    cache.unpin(h)
    cache.unpin(shorter)
    with pytest.raises(ValueError, match="holds no pin"):
        cache.unpin(shorter)
    assert cache.stats().pinned_pages == 0
    assert cache.evict(100) == 3
    with pytest.raises(ValueError, match="was evicted"):
        cache.pin(h)


def test_byte_accounting_is_exact_per_tier() -> None:
    codecs = ["fp8_e4m3", "fp8_e4m3", "int4"]
    cfg = CacheConfig(
        num_layers=3,
        kv_heads=2,
        head_dim=16,
        page_size=16,
        recent_window=32,
        layer_codecs=codecs,
        cold_budget_bytes=100_000,
        max_running=3,
        sinks=True,
    )
    cache = StratifiedKVCache(cfg)
    page = cold_page_bytes(codecs, 16, 2, 16)
    by_parts = sum(
        math.prod(shape) * dtype.itemsize
        for name in codecs
        for gran in ("channel", "token")
        for shape, dtype in get_codec(name).page_parts(16, 2, 16, gran).values()
    )
    codes = 2 * (2 * 16 * 2 * 16) + (2 * 16 * 2 * 16) // 2  # fp8: 1 byte, int4: half a byte
    assert page == by_parts and codes < page < codes * 1.3
    assert cache.num_pages == 100_000 // page
    stats = cache.stats()
    cold, ring, sink = stats.tiers["cold"], stats.tiers["ring"], stats.tiers["sink"]
    assert cold.bytes("total") == cache.pool.total_bytes == cache.num_pages * page <= 100_000
    assert ring.bytes("total") == cache.ring.total_bytes == 3 * (32 + 16) * 3 * 2 * 2 * 16 * 2
    assert ring.bytes_per_token == 3 * 2 * 2 * 16 * 2 and cold.bytes_per_token == page / 16
    assert sink.bytes("total") == cache.sinks.total_bytes == 6 * 3 * 16 * 2 * 16 * 2 * 2
    cache.check_invariants()


def test_cancel_step_gives_back_its_pages_and_reset_needs_no_running() -> None:
    cache = small_cache(num_pages=16)
    seq = cache.admit(list(range(30)))
    batch = cache.begin_step([seq], [29])
    assert cache.num_free_pages == 16 - 7
    cache.cancel_step(batch)
    assert cache.num_free_pages == 16 and seq.page_ids == [] and seq.length == 0
    cache.check_invariants()
    run_step(cache, [seq], [29], DATA, SCALE)
    with pytest.raises(RuntimeError, match="1 sequences are still running"):
        cache.reset()
    cache.finish(seq)
    cache.reset()
    assert cache.num_free_pages == 16 and cache.tree.total_pages == 0
    cache.check_invariants()


def test_cancel_after_a_layer_marks_only_sequences_whose_live_ring_rows_were_overwritten() -> None:
    cache = small_cache(num_pages=32)  # ring of 8 + 4 = 12 rows per slot
    long, short = cache.admit(list(range(60))), cache.admit(list(range(100, 160)))
    run_step(cache, [long, short], [10, 10], DATA, SCALE)  # both rings hold positions [0, 10)
    # long: a 20-token chunk keeps positions [20, 30) in the ring, whose rows are those of [8, 18):
    # positions 8 and 9 are still live, so they are lost when the step is cancelled after a layer.
    # short: one decode token writes the row of position 10, that of -2: nothing live.
    batch = cache.begin_step([long, short], [20, 1])
    parts = [DATA.span(None, s.token_ids, s.length, s.length + n) for s, n in ((long, 20), (short, 1))]
    q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
    cache.attention(0, batch, q, k, v, SCALE)
    cache.cancel_step(batch)
    assert long.ring_clobbered and not short.ring_clobbered
    with pytest.raises(ValueError, match="lost recent-window rows to a cancelled step"):
        cache.begin_step([long], [1])
    run_step(cache, [short], [1], DATA, SCALE)  # the untouched sequence goes on
    cache.finish(long)  # its two full pages are intact and go to the tree
    assert cache.match_prefix(list(range(60))).tokens == 8
    cache.finish(short)
    cache.check_invariants()


def test_misuse_is_reported() -> None:
    cache = small_cache(num_pages=16)
    seq = cache.admit(list(range(10)))
    with pytest.raises(ValueError, match="has 10 token ids, 0 cached, asked for 11 new"):
        cache.begin_step([seq], [11])
    batch = cache.begin_step([seq], [5])
    with pytest.raises(ValueError, match="already in an open step"):
        cache.begin_step([seq], [1])
    q, k, v = DATA.span(None, seq.token_ids, 0, 5)
    cache.attention(0, batch, q, k, v, SCALE)
    with pytest.raises(ValueError, match="layer 0 was already run"):
        cache.attention(0, batch, q, k, v, SCALE)
    with pytest.raises(ValueError, match=r"not run for layers \[1\]"):
        cache.end_step(batch)
    with pytest.raises(ValueError, match="in an open step"):
        cache.finish(seq)
    with pytest.raises(ValueError, match="do not fit 5 tokens"):
        cache.attention(1, batch, q[:4], k[:4], v[:4], SCALE)
    cache.attention(1, batch, q, k, v, SCALE)
    cache.end_step(batch)
    cache.finish(seq)
    with pytest.raises(ValueError, match="is not running"):
        cache.finish(seq)
    with pytest.raises(ValueError, match="layer_codecs has 1 entries for 2 layers"):
        CacheConfig(num_layers=2, kv_heads=1, head_dim=8, layer_codecs=["fp32"], num_pages=4)
    with pytest.raises(KeyError, match="valid codecs"):
        small_cache(layer_codecs=["fp3", "fp32"])


def test_invariant_violations_name_the_problem() -> None:
    from kvstrata.radix import InvariantViolation

    cache = small_cache(num_pages=16)
    cache.finish(prefill(cache, list(range(9))))
    node = next(cache.tree.nodes())
    cache.pool.allocator.free([node.pages[0]])
    with pytest.raises(InvariantViolation, match=rf"cold pages \[{node.pages[0]}\] are free but still held"):
        cache.check_invariants()
    cache.pool.allocator.alloc(1)
    cache.tree.evictable_pages += 1
    with pytest.raises(InvariantViolation, match="tree counts 3 evictable pages, nodes hold 2"):
        cache.check_invariants()


def test_bf16_ring_rounds_the_recent_window() -> None:
    cache = small_cache(num_pages=16, ring_dtype=torch.bfloat16)
    assert cache.ring.k.dtype == torch.bfloat16
    assert cache.stats().tiers["ring"].bytes_per_token == 2 * 2 * 2 * 8 * 2


def test_an_admission_rolled_back_before_its_first_step_counts_no_hit() -> None:
    cache = small_cache(num_pages=64)
    tokens = list(range(1, 30))
    cache.finish(prefill(cache, tokens))  # 28 tokens (7 pages) enter the tree
    seq = cache.admit(tokens)  # matches 7 pages ...
    assert seq.cached_tokens == 28
    cache.finish(seq, insert=False)  # ... but is rolled back (pressure) before it runs
    stats = cache.stats()
    assert (stats.matched_tokens, stats.missed_tokens) == (0, 29)
    cache.finish(prefill(cache, tokens))  # the admission that runs counts once
    stats = cache.stats()
    assert (stats.matched_tokens, stats.missed_tokens) == (28, 29 + 1)


def test_a_plan_that_fails_leaves_nothing_attached(monkeypatch: pytest.MonkeyPatch) -> None:
    import kvstrata.radix.cache as cache_module

    cache = small_cache(num_pages=16, sinks=True, sink_pages=4)
    seq = cache.admit(list(range(1, 20)))

    def failing(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("injected")

    monkeypatch.setattr(cache_module, "build_step", failing)
    with pytest.raises(torch.OutOfMemoryError):
        cache.begin_step([seq], [19])
    assert not seq.in_step and seq.page_ids == []
    assert cache.stats().tiers["cold"].used == 0 and cache.sinks is not None and not cache.sinks.of_page
    cache.check_invariants()
    cache.finish(seq)  # it can still end cleanly
    cache.check_invariants()
