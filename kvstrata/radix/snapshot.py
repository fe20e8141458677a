"""`snapshot`: build a `CacheStats` from a cache's pool, ring, sinks, tree and counters."""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvstrata.radix.stats import CacheStats, TierStats

if TYPE_CHECKING:
    from kvstrata.radix.cache import StratifiedKVCache
    from kvstrata.radix.pool import ColdPool


def snapshot(cache: StratifiedKVCache) -> CacheStats:
    """`CacheStats` of ``cache`` now: tiers in pages of ``page_size`` tokens, counters, quality."""
    cfg, P = cache.cfg, cache.page_size
    alloc, t = cache.pool.allocator, cache.tree
    # Raised pages count as text pages in the tree: the raised tier's share is counted from its nodes.
    raised_tree = _raised_tree_pages(cache)
    cold = TierStats(
        "cold",
        cache.pool.page_bytes,
        alloc.total,
        alloc.num_free,
        alloc.num_used,
        t.total_pages - t.image_pages - raised_tree[0],
        t.pinned_pages - t.pinned_image_pages - raised_tree[1],
        cache.pool.page_bytes / P,
        t.evictable_pages - t.evictable_image_pages - raised_tree[2],
    )
    slot_pages = cache.ring.capacity // P
    ring = TierStats(
        "ring",
        cache.ring.slot_bytes // slot_pages,
        cache.ring.slots.total * slot_pages,
        cache.ring.slots.num_free * slot_pages,
        cache.ring.slots.num_used * slot_pages,
        bytes_per_token=float(cache.ring.bytes_per_token),
    )
    tiers = {"cold": cold, "ring": ring}
    if cache.image_pool is not None:
        image_tree = (t.image_pages, t.pinned_image_pages, t.evictable_image_pages)
        tiers["image"] = _pool_tier("image", cache.image_pool, image_tree)
    if cache.raised_pool is not None:
        tiers["raised"] = _pool_tier("raised", cache.raised_pool, raised_tree)
    if cache.sinks is not None:
        s = cache.sinks.allocator
        tiers["sink"] = TierStats(
            "sink",
            cache.sinks.page_bytes,
            s.total,
            s.num_free,
            s.num_used,
            cache.tree.first_nodes,  # each node at position 0 has the sink of its first page
            0,
            cache.sinks.page_bytes / P,
            cache.tree.evictable_first_nodes,
        )
    return CacheStats(
        tiers=tiers,
        running=len(cache.running),
        quantized_pages=cache.quantized_pages,
        evicted_pages=cache.evicted_pages,
        pinned_pages=cache.tree.pinned_pages,
        matched_tokens=cache.matched_tokens,
        missed_tokens=cache.missed_tokens,
        quantized_elements=cache.quantized_pages * P * cfg.kv_heads * cfg.head_dim,
        recent_window=cache.recent_window,
        overflow_k=list(cache.overflow["k"]),
        overflow_v=list(cache.overflow["v"]),
        nonfinite_k=list(cache.nonfinite["k"]),
        nonfinite_v=list(cache.nonfinite["v"]),
        absmax_k=list(cache.absmax["k"]),
        absmax_v=list(cache.absmax["v"]),
        absmax_ratio_k=_absmax_ratio(cache, "k"),
        absmax_ratio_v=_absmax_ratio(cache, "v"),
        pinned_bytes=cache.pins.pinned_bytes,
        pin_budget_bytes=cache.pin_budget_bytes,
        pins_created=cache.pins.created,
        pins_expired=cache.pins.expired,
        pins_refused=cache.pins.refused,
        pins=cache.pins.to_json(),
    )


def _pool_tier(name: str, pool: ColdPool, tree: tuple[int, int, int]) -> TierStats:
    """The tier of a pool whose (in the tree, pinned, evictable) pages are ``tree``."""
    a, (cached, pinned, evictable) = pool.allocator, tree
    per_token = pool.page_bytes / pool.page_size
    return TierStats(
        name, pool.page_bytes, a.total, a.num_free, a.num_used, cached, pinned, per_token, evictable
    )


def _raised_tree_pages(cache: StratifiedKVCache) -> tuple[int, int, int]:
    """(in the tree, pinned, evictable) raised pages, counted from the tree's nodes (0s without a
    raised pool)."""
    if cache.raised_pool is None:
        return 0, 0, 0
    cached = pinned = evictable = 0
    for node in cache.tree.nodes():
        n = sum(1 for p in node.pages if cache.is_raised_page(p))
        cached += n
        pinned += n if node.pin_ref > 0 else 0
        evictable += 0 if node.protected else n
    return cached, pinned, evictable


def _absmax_ratio(cache: StratifiedKVCache, kind: str) -> list[float]:
    """Running absmax / the calibration clip (its largest entry), per layer; empty without scales."""
    if cache.cfg.scales is None:
        return []
    index = 0 if kind == "k" else 1
    ratios = []
    for layer, clips in enumerate(cache.clips):
        clip = clips[index]
        top = float(clip.max()) if clip is not None else 0.0
        ratios.append(cache.absmax[kind][layer] / top if top > 0 else 0.0)
    return ratios
