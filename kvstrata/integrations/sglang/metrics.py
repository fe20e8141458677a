"""kvstrata's metrics inside SGLang, prefix ``kvstrata:``, created lazily in the scheduler process.

SGLang runs prometheus_client in multiprocess mode with ``--enable-metrics``: a metric created in
the scheduler process (the cache factory runs there) is exported on SGLang's ``/metrics``. Creating
them at plugin load would also create them in the HTTP and detokenizer processes, so they are built
on first use, once per process.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

_BY_REGISTRY: dict[int, CacheMetrics] = {}


def kv_size_bytes(kvcache) -> int:
    """Bytes of SGLang's KV pool ``kvcache``: its ``get_kv_size_bytes()`` is (K, V) for MHA pools,
    one number for MLA's."""
    sizes = kvcache.get_kv_size_bytes()
    return int(sizes) if isinstance(sizes, int) else int(sum(sizes))


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        kw = {} if registry is None else {"registry": registry}
        gauge = {"multiprocess_mode": "mostrecent", **kw}
        self.pages = Gauge("kvstrata:pages", "KV pool pages by tier and state", ["tier", "state"], **gauge)
        self.bytes = Gauge("kvstrata:bytes", "Allocated KV bytes by tier", ["tier"], **gauge)
        self.pinned_bytes = Gauge("kvstrata:pinned_bytes", "Bytes of pinned prefixes", **gauge)
        self.pin_budget_bytes = Gauge("kvstrata:pin_budget_bytes", "Pinned-bytes budget", **gauge)
        self.evicted_pages = Counter("kvstrata:evicted_pages", "Pages evicted from the radix tree", **kw)
        self.pages_quantized = Counter("kvstrata:pages_quantized", "Pages quantized into the cold tier", **kw)
        self.overflow = Counter("kvstrata:overflow_elements", "Elements clipped by static scales", **kw)
        self._seen_quantized = self._seen_overflow = 0

    def observe(self, cache) -> None:
        """Refresh the gauges from ``cache`` (a `KvstrataRadixCache`) and its pool."""
        P = cache.page_size
        allocator = cache.token_to_kv_pool_allocator
        pinned = cache.pinned_pages()
        tree = cache.total_size() // P
        self.pages.labels("cold", "free").set(allocator.available_size() // P)
        self.pages.labels("cold", "tree").set(tree - pinned)
        self.pages.labels("cold", "pinned").set(pinned)
        self.pinned_bytes.set(pinned * cache.page_bytes)
        self.pin_budget_bytes.set(cache.pin_budget_bytes)
        kvcache = allocator.get_kvcache()
        self.bytes.labels("cold").set(kv_size_bytes(kvcache))
        ring_bytes = getattr(kvcache, "ring_bytes", 0)
        self.bytes.labels("ring").set(ring_bytes)
        quantized, overflow = getattr(kvcache, "quantized_pages", 0), getattr(kvcache, "overflow", 0)
        self.pages_quantized.inc(quantized - self._seen_quantized)
        self.overflow.inc(overflow - self._seen_overflow)
        self._seen_quantized, self._seen_overflow = quantized, overflow


def cache_metrics(registry: CollectorRegistry | None = None) -> CacheMetrics:
    """The metrics of this process for ``registry`` (default: prometheus_client's), made once."""
    key = id(registry)
    if key not in _BY_REGISTRY:
        _BY_REGISTRY[key] = CacheMetrics(registry)
    return _BY_REGISTRY[key]
