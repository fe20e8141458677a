"""`KvstrataRadixCache` (``--radix-cache-backend kvstrata``): SGLang's radix tree plus pinned prefixes.

A pinned prefix is immutable and never evicted: pinning takes one lock reference on the node (so
SGLang's own eviction, which only takes unlocked leaves, skips it and its ancestors) within a
pinned-bytes budget. After every insert of a request's tokens (``checkpoint`` in SGLang 0.5.23,
``cache_unfinished_req``/``cache_finished_req`` in 0.5.17), the prefix ending at each multimodal
pad-token span (SGLang replaces image tokens with pad values from ``MM_PAD_SHIFT_VALUE`` up, derived from the
image hash) is pinned when the budget allows, so a repeated image's KV stays cached.
"""

from __future__ import annotations

import logging
from array import array

from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE
from sglang.srt.mem_cache.base_prefix_cache import EvictParams, EvictResult, MatchPrefixParams
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey, TreeNode

from kvstrata.integrations.sglang import compat
from kvstrata.integrations.sglang.metrics import CacheMetrics, kv_size_bytes
from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.integrations.sglang.pool import StratifiedTokenToKVPool
from kvstrata.radix.errors import PinBudgetExceeded

logger = logging.getLogger(__name__)


def page_bytes_of(kvcache, page_size: int) -> int:
    """Exact bytes one page of ``kvcache`` takes, all layers, K and V."""
    if isinstance(kvcache, StratifiedTokenToKVPool):
        return kvcache.cold.page_bytes
    return kv_size_bytes(kvcache) // (kvcache.size + kvcache.page_size) * page_size


class KvstrataRadixCache(RadixCache):
    def __init__(self, params, options: PluginOptions, metrics: CacheMetrics | None = None) -> None:
        self.pinned: dict[int, TreeNode] = {}
        super().__init__(params)
        self.options = options
        kvcache = self.token_to_kv_pool_allocator.get_kvcache()
        self.page_bytes = page_bytes_of(kvcache, self.page_size)
        total_pages = self.token_to_kv_pool_allocator.size // self.page_size
        self.pin_budget_bytes = (
            options.pin_budget_bytes
            if options.pin_budget_bytes is not None
            else total_pages * self.page_bytes // 4
        )
        self.kv_metrics = metrics
        self.pins_refused = 0

    def reset(self) -> None:
        super().reset()
        self.pinned = {}

    # ---- pins ----------------------------------------------------------------------------------
    def path_nodes(self, node: TreeNode) -> list[TreeNode]:
        nodes = []
        while node is not self.root_node:
            nodes.append(node)
            node = node.parent
        return nodes

    def pinned_pages(self) -> int:
        seen: dict[int, TreeNode] = {}
        for node in self.pinned.values():
            for n in self.path_nodes(node):
                seen[n.id] = n
        return sum(len(n.key) for n in seen.values()) // self.page_size

    def pinned_bytes(self) -> int:
        return self.pinned_pages() * self.page_bytes

    def pin(self, node: TreeNode) -> None:
        """Pin the prefix ending at ``node``; `PinBudgetExceeded` (nothing changes) past the budget."""
        if node is self.root_node or node is None:
            raise ValueError("pin: empty prefix")
        if node.evicted:
            raise ValueError("pin: the prefix was evicted")
        if node.id in self.pinned:
            return
        pinned_ids = {n.id for p in self.pinned.values() for n in self.path_nodes(p)}
        extra = sum(len(n.key) for n in self.path_nodes(node) if n.id not in pinned_ids) // self.page_size
        now = self.pinned_bytes()
        if now + extra * self.page_bytes > self.pin_budget_bytes:
            raise PinBudgetExceeded(
                f"pinning {extra * self.page_bytes} more bytes would make {now + extra * self.page_bytes} "
                f"pinned bytes, over the pin budget of {self.pin_budget_bytes} bytes"
            )
        self.inc_lock_ref(node)
        self.pinned[node.id] = node
        self._record()

    def unpin(self, node: TreeNode) -> None:
        if node.id not in self.pinned:
            raise ValueError("unpin: the prefix is not pinned")
        del self.pinned[node.id]
        self.dec_lock_ref(node)
        self._record()

    def pin_prefix(self, key: RadixKey) -> TreeNode:
        """Pin the longest cached page-aligned prefix of ``key``; returns its node."""
        node = self.match_prefix(MatchPrefixParams(key=key)).last_device_node
        self.pin(node)
        return node

    # ---- SGLang hooks --------------------------------------------------------------------------
    if compat.HAS_CHECKPOINT:

        def checkpoint(self, req, *, up_to: int):
            super().checkpoint(req, up_to=up_to)
            self.pin_after_insert(req, req.full_untruncated_fill_ids[:up_to])

    else:

        def cache_unfinished_req(self, req, chunked=False):
            super().cache_unfinished_req(req, chunked=chunked)
            self.pin_after_insert(req, req.get_fill_ids())

        def cache_finished_req(self, req, is_insert: bool = True, *, kv_len_to_handle: int):
            super().cache_finished_req(req, is_insert, kv_len_to_handle=kv_len_to_handle)
            if is_insert and not self.disable_finished_insert:
                self.pin_after_insert(req, (req.origin_input_ids + req.output_ids)[:kv_len_to_handle])

    def pin_after_insert(self, req, token_ids) -> None:
        if self.options.pin_multimodal and not self.disable:
            self.pin_multimodal_spans(req, token_ids)

    def pin_multimodal_spans(self, req, token_ids) -> int:
        """Pin the cached prefix through each pad-token span's last full page; returns pins made."""
        P, made = self.page_size, 0
        ends = [i + 1 for i, t in enumerate(token_ids) if t >= MM_PAD_SHIFT_VALUE]
        span_ends = [e for i, e in enumerate(ends) if i + 1 == len(ends) or ends[i + 1] != e + 1]
        for end in span_ends:
            aligned = end // P * P
            if aligned == 0:
                continue
            salt = getattr(req, "cache_salt", None)
            key = compat.radix_key(array("q", token_ids[:aligned]), req.extra_key, salt)
            node = self.match_prefix(MatchPrefixParams(key=key)).last_device_node
            if node is self.root_node or node.id in self.pinned:
                continue
            try:
                self.pin(node)
                made += 1
            except PinBudgetExceeded as exc:
                self.pins_refused += 1
                logger.warning("kvstrata: image prefix not pinned: %s", exc)
        return made

    def evict(self, params: EvictParams) -> EvictResult:
        result = super().evict(params)
        if self.kv_metrics is not None and result.num_tokens_evicted:
            self.kv_metrics.evicted_pages.inc(result.num_tokens_evicted // self.page_size)
        self._record()
        return result

    def _record(self) -> None:
        if self.kv_metrics is not None:
            self.kv_metrics.observe(self)

    def check_invariants(self, held_slots=None) -> None:
        from kvstrata.integrations.sglang.invariants import check_invariants

        check_invariants(self, held_slots)
