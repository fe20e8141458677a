"""Insert / match / lock / evict / pin on `KvstrataRadixCache` with SGLang's own allocator and
``ReqToTokenPool``; kvstrata's invariants are checked after every step."""

from __future__ import annotations

from array import array
from types import SimpleNamespace

import pytest
import torch

from kvstrata.integrations.sglang.options import PluginOptions
from kvstrata.integrations.sglang.pool import pool_class
from kvstrata.radix.errors import InvariantViolation, PinBudgetExceeded
from tests.integrations.sglang.conftest import PAGE, alloc_row, free_row, make_pools, matched_slots


class Harness:
    """Requests as SGLang's scheduler runs them: a ``ReqToTokenPool`` row, paged slots from the
    allocator, then the page-aligned prefix inserted into the tree and duplicate slots freed."""

    def __init__(self, options: PluginOptions, metrics=None) -> None:
        from sglang.srt.mem_cache.cache_init_params import CacheInitParams
        from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

        from kvstrata.integrations.sglang.radix_cache import KvstrataRadixCache

        pool_cls = pool_class(options) if options.stratified else MHATokenToKVPool
        self.req_pool, self.kv, self.allocator = make_pools(pool_cls)
        params = CacheInitParams(
            disable=False,
            req_to_token_pool=self.req_pool,
            token_to_kv_pool_allocator=self.allocator,
            page_size=PAGE,
        )
        self.cache = KvstrataRadixCache(params, options, metrics)
        self.held: dict[int, torch.Tensor] = {}

    def key(self, tokens):
        from sglang.srt.mem_cache.radix_cache import RadixKey

        return RadixKey(array("q", tokens))

    def check(self) -> None:
        held = [t for t in self.held.values() if t.numel()]
        self.cache.check_invariants(torch.cat(held) if held else None)

    def start(self, tokens: list[int]):
        """Match the cached prefix, lock it, allocate the rest; returns (row, match)."""
        from sglang.srt.mem_cache.base_prefix_cache import MatchPrefixParams

        match = self.cache.match_prefix(MatchPrefixParams(key=self.key(tokens)))
        self.cache.inc_lock_ref(match.last_device_node)
        prefix = matched_slots(self.cache, match)
        need = -(-(len(tokens) - len(prefix)) // PAGE) * PAGE
        new = self.allocator.alloc(need)
        row = alloc_row(self.req_pool)
        self.req_pool.write((row, slice(0, len(prefix) + need)), torch.cat([prefix, new]).to(torch.int32))
        self.held[row] = new
        return row, match

    def finish(self, row: int, tokens: list[int], match) -> None:
        """Insert the full pages, free what the tree already had and the partial page, unlock."""
        from sglang.srt.mem_cache.base_prefix_cache import InsertParams

        full = len(tokens) // PAGE * PAGE
        slots = self.req_pool.req_to_token[row, :full].to(torch.int64)
        cached = len(matched_slots(self.cache, match))
        result = self.cache.insert(InsertParams(key=self.key(tokens[:full]), value=slots))
        dup = slots[cached : result.prefix_len]
        tail = self.held.pop(row)[full - cached :]
        for part in (dup, tail):
            if part.numel():
                self.allocator.free(part)
        self.cache.dec_lock_ref(match.last_device_node)
        free_row(self.req_pool, row)

    def run(self, tokens: list[int]) -> None:
        row, match = self.start(tokens)
        self.check()
        self.finish(row, tokens, match)
        self.check()


def tokens(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.fixture(params=["fp8_e4m3", "auto"])
def h(request):
    """The cache over kvstrata's stratified pool (fp8 history) and over SGLang's own BF16 pool
    (``KVSTRATA_KV_CODEC=auto``)."""
    return Harness(PluginOptions(codec=request.param, recent_window=2 * PAGE, pin_budget_bytes=None))


def test_insert_match_lock_evict(h):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams, MatchPrefixParams

    total = h.allocator.available_size()
    a = tokens(100, 3 * PAGE + 2)
    h.run(a)
    assert h.cache.total_size() == 3 * PAGE
    assert h.allocator.available_size() == total - 3 * PAGE

    # B shares A's first two pages: the tree splits, B's duplicate pages return to the allocator.
    b = a[: 2 * PAGE] + tokens(900, 2 * PAGE)
    row, match = h.start(b)
    assert len(matched_slots(h.cache, match)) == 2 * PAGE
    h.check()
    # Locked: nothing on B's path can go; A's own third page can.
    evicted = h.cache.evict(EvictParams(num_tokens=10 * PAGE)).num_tokens_evicted
    assert evicted == PAGE
    h.check()
    h.finish(row, b, match)
    h.check()
    assert h.cache.total_size() == 4 * PAGE
    m = h.cache.match_prefix(MatchPrefixParams(key=h.key(b + [1])))
    assert len(matched_slots(h.cache, m)) == 4 * PAGE
    assert h.cache.evict(EvictParams(num_tokens=100 * PAGE)).num_tokens_evicted == 4 * PAGE
    h.check()
    assert h.allocator.available_size() == total


def test_pins_survive_eviction_within_budget(h):
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    budget_pages = h.cache.pin_budget_bytes // h.cache.page_bytes
    assert budget_pages == 64 // 4
    a, b = tokens(0, 6 * PAGE), tokens(5000, 12 * PAGE)
    h.run(a)
    h.run(b)
    node_a = h.cache.pin_prefix(h.key(a[: 4 * PAGE]))
    h.check()
    assert h.cache.pinned_bytes() == 4 * h.cache.page_bytes
    # B's 12 pages would make 16 pinned pages: within the budget of 16.
    node_b = h.cache.pin_prefix(h.key(b))
    assert h.cache.pinned_pages() == 16
    h.cache.unpin(node_b)
    h.cache.pin_prefix(h.key(b[: 8 * PAGE]))
    node_a_all = h.cache.pin_prefix(h.key(a))
    assert h.cache.pinned_pages() == 6 + 8
    before = h.cache.pinned_bytes()
    with pytest.raises(PinBudgetExceeded):
        h.cache.pin_prefix(h.key(b))  # 4 more pages: 18 > 16
    assert h.cache.pinned_bytes() == before
    h.check()
    # Only B's unpinned last 4 pages can go.
    assert h.cache.evict(EvictParams(num_tokens=100 * PAGE)).num_tokens_evicted == 4 * PAGE
    h.check()
    assert h.cache.total_size() == 14 * PAGE
    h.cache.unpin(node_a_all)
    h.cache.unpin(node_a)
    assert h.cache.evict(EvictParams(num_tokens=100 * PAGE)).num_tokens_evicted == 6 * PAGE
    h.check()
    assert h.cache.pinned_pages() == 8


def test_multimodal_pad_spans_are_pinned(h):
    from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE

    image = [MM_PAD_SHIFT_VALUE + 77] * (2 * PAGE + 1)
    prompt = tokens(10, PAGE) + image + tokens(40, 2 * PAGE)
    h.run(prompt)
    req = SimpleNamespace(extra_key=None, cache_salt=None)
    assert h.cache.pin_multimodal_spans(req, prompt) == 1
    # The span ends inside page 3: pages 0..2 (text page + two full image pages) are pinned.
    assert h.cache.pinned_pages() == 3
    assert h.cache.pin_multimodal_spans(req, prompt) == 0
    h.check()


def test_invariants_catch_a_leaked_page(h):
    a = tokens(0, 2 * PAGE)
    row, _ = h.start(a)
    with pytest.raises(InvariantViolation, match="leaked"):
        h.cache.check_invariants()  # the running request's slots are not declared
    h.check()


@pytest.mark.parametrize("codec", ["int8", "auto"])
def test_metrics_follow_pins_and_evictions(codec):
    from prometheus_client import CollectorRegistry
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    from kvstrata.integrations.sglang.metrics import CacheMetrics

    registry = CollectorRegistry()
    h = Harness(PluginOptions(codec=codec, recent_window=PAGE), CacheMetrics(registry))
    h.run(tokens(0, 5 * PAGE))
    node = h.cache.pin_prefix(h.key(tokens(0, 2 * PAGE)))

    def sample(name, **labels):
        return registry.get_sample_value(name, labels)

    assert sample("kvstrata:pinned_bytes") == 2 * h.cache.page_bytes
    assert sample("kvstrata:pages", tier="cold", state="pinned") == 2
    assert sample("kvstrata:pages", tier="cold", state="tree") == 3
    assert sample("kvstrata:pages", tier="cold", state="free") == 64 - 5
    assert sample("kvstrata:bytes", tier="cold") == 65 * h.cache.page_bytes
    # SGLang's own pool (auto): BF16 pages of 2 layers x (K + V) x 4 tokens x 2 heads x 16 dims
    assert bool(h.cache.page_bytes == 2 * 2 * PAGE * 2 * 16 * 2) is (codec == "auto")
    h.cache.evict(EvictParams(num_tokens=100 * PAGE))
    assert sample("kvstrata:evicted_pages_total") == 3
    h.cache.unpin(node)
    assert sample("kvstrata:pinned_bytes") == 0
    h.check()


def cache_through_sglang(h, prompt: list[int]) -> None:
    """A finished request's prompt cached by SGLang's own cache API: ``checkpoint`` (0.5.23) or
    ``cache_finished_req`` (0.5.17), with a real ``Req``; then its row and tail slots are released."""
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.sampling.sampling_params import SamplingParams

    req = Req("r0", "", array("q", prompt), SamplingParams())
    row = alloc_row(h.req_pool)
    need = -(-len(prompt) // PAGE) * PAGE
    h.req_pool.write((row, slice(0, need)), h.allocator.alloc(need).to(torch.int32))
    if hasattr(h.cache, "checkpoint"):
        req.refresh_fill_ids()  # as the scheduler's init_next_round_input does
        req.kv.req_pool_idx = row
        h.cache.checkpoint(req, up_to=len(prompt))
        h.cache.unlock(req.lock)
        tail = h.req_pool.req_to_token[row, req.kv.cache_protected_len : need].to(torch.int64)
        h.allocator.free(tail)
    else:
        req.req_pool_idx = row
        h.cache.cache_finished_req(req, kv_len_to_handle=len(prompt))
    free_row(h.req_pool, row)


def test_image_prefix_pinned_through_sglang_cache_api(h):
    from sglang.srt.managers.schedule_batch import MM_PAD_SHIFT_VALUE
    from sglang.srt.mem_cache.base_prefix_cache import EvictParams

    image = [MM_PAD_SHIFT_VALUE + 5] * (2 * PAGE + 1)
    prompt = tokens(10, PAGE) + image + tokens(40, PAGE + 2)
    cache_through_sglang(h, prompt)
    h.check()
    assert h.cache.total_size() == len(prompt) // PAGE * PAGE
    assert h.cache.pinned_pages() == 3  # the text page and the image's two full pages
    assert h.cache.evict(EvictParams(num_tokens=100 * PAGE)).num_tokens_evicted == PAGE
    h.check()
