"""The raised pool (the drift fallback's precision raise): while the cache is raised, new text pages are
written in the raised pool's wider codecs; pages keep the pool they were written in (shared prefixes
too), attention reads each page in its own pool's codec, the two pools are one text capacity (spill
before evicting), bytes and pins are exact per pool, and nothing leaks."""

from __future__ import annotations

import pytest
import torch
from radix_helpers import TokenKV, dense_attention, roundtrip, run_step, small_cache

from kvstrata.quant import get_codec
from kvstrata.radix import CacheConfig, OutOfPages
from kvstrata.radix.pool import KEY_GRANULARITY, VALUE_GRANULARITY, cold_page_bytes, split_layer_codec

DATA = TokenKV(kv_heads=2, q_heads=4, head_dim=8)
SCALE = 8**-0.5
P = 4
SHIPPED, RAISED = "int4", "int8"


def raised_cache(**overrides: object):
    params: dict[str, object] = dict(
        layer_codecs=[SHIPPED, SHIPPED],
        raised_codecs=[RAISED, "fp8_e4m3/int8"],
        raised_pages=8,
        recent_window=0,
    )
    params.update(overrides)
    return small_cache(**params)


def reference(cache, seq, n: int, layer: int, as_shipped: bool = False) -> torch.Tensor:
    """Dense attention of ``seq``'s next ``n`` tokens over K/V whose cold pages went through the codec of
    the pool holding them (or all through the shipped codec)."""
    L, stop = seq.length, seq.length + n
    q, k, v = DATA.span(seq.extra_key, seq.token_ids, 0, stop)
    k, v = k.clone(), v.clone()
    for j in range(seq.ring_start // P):
        pool, _, _ = cache.pool_of(seq.page_ids[j])
        kc, vc = split_layer_codec((cache.pool if as_shipped else pool).codec_names[layer])
        rows = slice(j * P, (j + 1) * P)
        k[rows] = roundtrip(kc, k[rows], KEY_GRANULARITY)
        v[rows] = roundtrip(vc, v[rows], VALUE_GRANULARITY)
    return dense_attention(q[L:stop], k, v, L, SCALE)


def step_and_compare(cache, seqs, n_new) -> float:
    """One step; every layer's output equals the per-pool reference; returns the largest distance from
    the all-int4 reference (how much the raised pages changed the answer)."""
    pairs = list(zip(seqs, n_new, strict=True))
    refs = [[reference(cache, s, n, layer) for s, n in pairs] for layer in (0, 1)]
    shipped = [[reference(cache, s, n, layer, True) for s, n in pairs] for layer in (0, 1)]
    outs = run_step(cache, seqs, n_new, DATA, SCALE)
    gap = 0.0
    for layer, out in enumerate(outs):
        row = 0
        for ref, ship, n in zip(refs[layer], shipped[layer], n_new, strict=True):
            got = out[row : row + n].double()
            torch.testing.assert_close(got, ref, atol=1e-5, rtol=0)
            gap = max(gap, float((got - ship).abs().max()))
            row += n
    cache.check_invariants()
    return gap


def raised_flags(cache, seq) -> list[bool]:
    return [cache.is_raised_page(p) for p in seq.page_ids]


@pytest.mark.parametrize("block_pages", [64, 1])
def test_new_pages_follow_the_level_and_keep_their_codec(block_pages: int):
    cache = raised_cache(block_pages=block_pages)
    seq = cache.admit(list(range(1, 40)))
    gaps = [step_and_compare(cache, [seq], [9])]  # pages 0-1 at the shipped level
    cache.set_raised(True)
    gaps += [step_and_compare(cache, [seq], [n]) for n in (7, 1, 1, 1)]  # pages 2-3 (4 is not full yet)
    cache.set_raised(False)
    gaps += [step_and_compare(cache, [seq], [n]) for n in (8, 4)]  # pages 4-6, shipped again
    assert raised_flags(cache, seq) == [False, False, True, True, False, False, False]
    assert max(gaps) > 1e-2  # the raised pages' codecs gave another answer than int4 everywhere
    tiers = cache.stats().tiers
    assert (tiers["raised"].used, tiers["cold"].used) == (2, 5)
    cache.finish(seq)
    cache.check_invariants()


def test_shared_prefix_keeps_its_pool_across_level_changes():
    cache = raised_cache()
    a = list(range(1, 18))  # 4 full pages + 1 token
    first = cache.admit(a)
    step_and_compare(cache, [first], [17])
    cache.finish(first)  # 4 shipped pages in the tree
    cache.set_raised(True)
    b = cache.admit([*a[:16], *range(100, 113)])  # 7 full pages: 4 from the tree, 3 new
    assert b.cached_tokens == 16
    step_and_compare(cache, [b], [13])
    assert raised_flags(cache, b) == [False] * 4 + [True] * 3
    cache.finish(b)
    cache.set_raised(False)
    c = cache.admit([*a[:16], *range(100, 112), 7, 8, 9, 10, 11])  # B's raised pages read from the tree
    assert c.cached_tokens == 28
    step_and_compare(cache, [c], [5])
    assert raised_flags(cache, c) == [False] * 4 + [True] * 3 + [False]
    cache.finish(c)
    assert cache.stats().tiers["raised"].cached == 3 and cache.stats().tiers["cold"].cached == 5
    cache.check_invariants()


def test_pool_accounting_exact_spill_and_eviction_into_the_right_pool():
    cache = raised_cache(num_pages=6, raised_pages=4)
    assert cache.num_pages == 10 and cache.num_free_pages == 10
    raised, text = cache.raised_pool, cache.pool
    int4 = get_codec(SHIPPED)
    assert text.page_bytes == 2 * (int4.page_bytes(P, 2, 8, "channel") + int4.page_bytes(P, 2, 8, "token"))
    tiers = cache.stats().tiers
    expected = cold_page_bytes([RAISED, "fp8_e4m3/int8"], P, 2, 8)
    assert tiers["raised"].unit_bytes == raised.page_bytes == expected
    assert raised.page_bytes != text.page_bytes  # pins below count each page at its own pool's bytes
    assert tiers["raised"].bytes("total") == sum(
        t[: raised.null_page].nbytes for bufs in (*raised.k, *raised.v) for t in bufs.values()
    )
    cache.set_raised(True)
    s1 = cache.admit(list(range(1, 26)))  # 6 full pages: 4 raised, then 2 spill into the text pool
    step_and_compare(cache, [s1], [25])
    assert raised_flags(cache, s1) == [True] * 4 + [False] * 2
    assert (raised.allocator.num_free, text.allocator.num_free) == (0, 4)
    cache.finish(s1)
    cache.set_raised(False)
    s2 = cache.admit(list(range(200, 221)))  # 5 pages: 4 free text pages, then s1's leaf evicted
    step_and_compare(cache, [s2], [21])
    assert cache.evicted_pages == 6  # s1's leaf went whole: its 4 raised and 2 text pages freed
    assert raised_flags(cache, s2) == [False] * 5
    cache.finish(s2)
    s3 = cache.admit(list(range(300, 313)))  # 3 pages at the shipped level: 1 text page left, 2 spill
    step_and_compare(cache, [s3], [13])
    assert raised_flags(cache, s3) == [False, True, True] and cache.evicted_pages == 6
    cache.finish(s3)
    tiers = cache.stats().tiers
    raised_tier, cold_tier = tiers["raised"], tiers["cold"]
    assert (raised_tier.used, raised_tier.free, cold_tier.used, cold_tier.free) == (2, 2, 6, 0)
    # a pin counts each pool's page bytes
    cache.pin_budget_bytes = 10**6
    cache.pins.pin(list(range(300, 313)))
    assert cache.pinned_bytes == text.page_bytes + 2 * raised.page_bytes
    assert cache.stats().tiers["raised"].pinned == 2 and cache.stats().tiers["cold"].pinned == 1
    cache.check_invariants()
    s4 = cache.admit(list(range(400, 434)))  # 8 pages: 2 free + 5 evictable is not enough
    with pytest.raises(OutOfPages, match="need 8 cold pages: 2 free, 5 evictable, 3 locked or pinned"):
        cache.begin_step([s4], [33])
    cache.finish(s4, insert=False)
    cache.check_invariants()
    cache.reset()
    assert cache.num_free_pages == 10 and raised.allocator.num_free == 4
    cache.check_invariants()


def test_no_leak_after_requests_finish_and_after_eviction():
    cache = raised_cache(num_pages=12, raised_pages=6, max_running=3)
    for round_ in range(4):
        cache.set_raised(round_ % 2 == 1)
        seqs = [cache.admit([round_ * 1000 + i * 100 + t for t in range(1, 15)]) for i in range(3)]
        step_and_compare(cache, seqs, [13, 13, 13])
        step_and_compare(cache, seqs, [1, 1, 1])
        for s in seqs:
            cache.finish(s)
        cache.check_invariants()
    assert cache.evicted_pages > 0
    assert cache.evict(100) > 0
    assert cache.num_free_pages == cache.num_pages == 18
    assert cache.raised_pool.allocator.num_free == 6 and cache.pool.allocator.num_free == 12
    cache.check_invariants()


def test_set_raised_needs_a_raised_pool_and_config_checks():
    with pytest.raises(ValueError, match="no raised pool"):
        small_cache().set_raised(True)
    with pytest.raises(ValueError, match="raised_codecs needs 2 entries"):
        CacheConfig(num_layers=2, kv_heads=1, head_dim=8, num_pages=4, raised_codecs=["int8"], raised_pages=2)
