"""Random operation sequences against a page-level reference model, invariants after every step.

The reference keeps the set of cached page prefixes ``(namespace, tokens[:k * P])`` with their last
use, the locks (running sequences' matched pages) and the pins. Each step checks: the cache's tree
holds exactly the reference's prefixes, matches are the longest cached prefix, attention equals
dense attention over the K/V a model would produce (fp32 storage: exact), tree pages never change,
evictions take unprotected leaves in LRU order, and exhaustion/budget errors change nothing.
Two machines (without and with attention sinks) run 1,000 sequences each.
"""

from __future__ import annotations

import math
from collections.abc import Hashable

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from radix_helpers import TokenKV, dense_attention

from kvstrata.radix import CacheConfig, OutOfPages, OutOfSlots, PinBudgetExceeded, StratifiedKVCache

P = 2
HKV, HQ, D = 1, 2, 4
SCALE = 1 / math.sqrt(D)
Key = tuple[Hashable, tuple[int, ...]]

# Prompts start with one of a few shared prefixes so that matches, splits and sharing are common.
PREFIXES = [(), (0, 0, 1, 1), (0, 0, 1, 1, 1, 0), (1, 1)]
tokens_st = st.tuples(st.sampled_from(PREFIXES), st.lists(st.integers(0, 1), max_size=5)).map(
    lambda t: [*t[0], *t[1]] or [0]
)
ns_st = st.sampled_from([None, "img"])


def page_keys(ns: Hashable, tokens: list[int] | tuple[int, ...], n_pages: int) -> list[Key]:
    return [(ns, tuple(tokens[: (i + 1) * P])) for i in range(n_pages)]


class RefSeq:
    def __init__(self, seq, locked: int) -> None:
        self.seq = seq
        self.locked = locked  # leading pages held through the tree


class CacheMachine(RuleBasedStateMachine):
    sinks = False
    block_pages = 64  # every history fits one attention pass

    def __init__(self) -> None:
        super().__init__()
        cfg = CacheConfig(
            num_layers=1,
            kv_heads=HKV,
            head_dim=D,
            page_size=P,
            recent_window=2,
            max_recent_window=4,
            layer_codecs=["fp32"],
            ring_dtype=torch.float32,
            num_pages=12,
            max_running=3,
            sinks=self.sinks,
            sink_pages=3 if self.sinks else None,
            block_pages=self.block_pages,
        )
        self.cache = StratifiedKVCache(cfg)
        self.page_bytes = self.cache.pool.page_bytes
        self.cache.pin_budget_bytes = 4 * self.page_bytes
        self.data = TokenKV(HKV, HQ, D)
        self.cached: dict[Key, int] = {}  # page prefix -> last use (reference clock)
        self.clock = 0
        self.seqs: list[RefSeq] = []
        self.pins: list[Key] = []
        self.content: dict[Key, tuple[int, torch.Tensor, torch.Tensor]] = {}

    @initialize()
    def start(self) -> None:
        self.cache.check_invariants()

    # ---- reference helpers ----------------------------------------------------------------------
    def touch(self, keys: list[Key]) -> None:
        if keys:
            self.clock += 1
            for k in keys:
                self.cached[k] = self.clock

    def longest(self, ns: Hashable, tokens: list[int]) -> int:
        n = 0
        while (n + 1) * P <= len(tokens) and (ns, tuple(tokens[: (n + 1) * P])) in self.cached:
            n += 1
        return n

    def protected(self) -> set[Key]:
        out: set[Key] = set()
        for r in self.seqs:
            out.update(page_keys(r.seq.extra_key, r.seq.token_ids, r.locked))
        for ns, toks in self.pins:
            out.update(page_keys(ns, toks, len(toks) // P))
        return out

    def pinned(self) -> set[Key]:
        out: set[Key] = set()
        for ns, toks in self.pins:
            out.update(page_keys(ns, toks, len(toks) // P))
        return out

    def is_leaf(self, key: Key) -> bool:
        ns, toks = key
        return not any(
            k[0] == ns and len(k[1]) == len(toks) + P and k[1][: len(toks)] == toks for k in self.cached
        )

    def evictable(self) -> int:
        return len(set(self.cached) - self.protected())

    def sink_state(self) -> tuple[int, int]:
        """(sink pages in use, sink pages the tree could give back) in the reference."""
        firsts = [k for k in self.cached if len(k[1]) == P]
        private = sum(1 for r in self.seqs if r.seq.page_ids and r.locked == 0)
        return len(firsts) + private, len(set(firsts) - self.protected())

    def tree_keys(self) -> dict[Key, int]:
        """Page prefix -> page id, read from the cache's tree."""
        out: dict[Key, int] = {}
        for ns, root in self.cache.tree.roots().items():
            stack = [(c, ()) for c in root.children.values()]
            while stack:
                node, prefix = stack.pop()
                toks = prefix + node.tokens
                for i, page in enumerate(node.pages):
                    out[(ns, toks[: len(prefix) + (i + 1) * P])] = page
                stack.extend((c, toks) for c in node.children.values())
        return out

    def snapshot(self) -> tuple:
        c = self.cache
        return (
            sorted(c.pool.allocator.free_ids()),
            sorted(self.tree_keys().items(), key=repr),
            [(n.lock_ref, n.pin_ref, n.last_access) for n in c.tree.nodes()],
            c.ring.slots.free_ids(),
            [(s.seq.length, list(s.seq.page_ids)) for s in self.seqs],
            c.tree.pinned_pages,
            dict(c.sinks.of_page) if c.sinks else None,
        )

    def check_evictions(self, before: dict[Key, int], protected: set[Key], freed_need: int) -> None:
        after = set(self.tree_keys())
        evicted = set(before) - after
        assert not evicted & protected, f"evicted protected prefixes {evicted & protected}"
        if evicted:
            event("evicted")
        assert len(evicted) >= freed_need, f"evicted {len(evicted)} pages, needed {freed_need}"
        for k in evicted:
            del self.cached[k]
            self.content.pop(k, None)
        remaining_leaves = [k for k in self.cached if k not in protected and self.is_leaf(k)]
        if evicted and remaining_leaves:
            newest_evicted = max(before[k] for k in evicted)
            oldest_left = min(self.cached[k] for k in remaining_leaves)
            assert newest_evicted <= oldest_left, f"LRU broken: evicted {newest_evicted}, kept {oldest_left}"

    # ---- rules ----------------------------------------------------------------------------------
    @rule(tokens=tokens_st, ns=ns_st, prefill=st.booleans())
    def admit(self, tokens: list[int], ns: Hashable, prefill: bool) -> None:
        """Admit a prompt; with ``prefill``, also run the whole prompt as one step."""
        if self.cache.num_free_slots == 0:
            before = self.snapshot()
            try:
                self.cache.admit(tokens, ns)
            except OutOfSlots:
                assert self.snapshot() == before
                event("out of slots")
                return
            raise AssertionError("admit with no free slot did not raise OutOfSlots")
        limit = (len(tokens) - 1) // P * P
        n = self.longest(ns, tokens[:limit])
        seq = self.cache.admit(list(tokens), ns)
        assert seq.cached_tokens == n * P, (seq.cached_tokens, n * P)
        event(f"admit matched pages: {min(n, 2)}+")
        self.touch(page_keys(ns, tokens, n))
        r = RefSeq(seq, n)
        self.seqs.append(r)
        if prefill:
            self._step([r], [len(tokens) - seq.length])

    @rule(tokens=tokens_st, ns=ns_st)
    def serve(self, tokens: list[int], ns: Hashable) -> None:
        """A whole short request: admit, prefill, finish into the tree (fills the tree quickly)."""
        if self.cache.num_free_slots == 0:
            return
        self.admit(tokens, ns, prefill=True)
        r = self.seqs[-1]
        if r.seq.length == len(r.seq.token_ids):
            self.seqs.pop()
            self.cache.finish(r.seq, insert=True)
            self._insert(r)

    @rule(tokens=tokens_st, ns=ns_st)
    def match(self, tokens: list[int], ns: Hashable) -> None:
        n = self.longest(ns, tokens)
        m = self.cache.match_prefix(tokens, ns)
        assert m.tokens == n * P and len(m.page_ids) == n
        self.touch(page_keys(ns, tokens, n))

    @precondition(lambda self: self.seqs)
    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        chosen = data.draw(st.lists(st.sampled_from(self.seqs), min_size=1, max_size=3, unique_by=id))
        n_new = []
        for r in chosen:
            prompt_left = len(r.seq.token_ids) - r.seq.length
            n = data.draw(st.integers(1, min(prompt_left, 6)) if prompt_left else st.integers(1, 3))
            missing = max(r.seq.length + n - len(r.seq.token_ids), 0)
            r.seq.token_ids.extend(data.draw(st.lists(st.integers(0, 1), min_size=missing, max_size=missing)))
            n_new.append(n)
        self._step(chosen, n_new)

    def _step(self, chosen: list[RefSeq], n_new: list[int]) -> None:
        seqs = [r.seq for r in chosen]
        need = sum(self.cache.pages_for_step(s, n) for s, n in zip(seqs, n_new, strict=True))
        free = self.cache.num_free_pages
        ok = need <= free + self.evictable()
        need_sinks = 0
        if self.sinks:
            used, give_back = self.sink_state()
            need_sinks = sum(
                1
                for s, n in zip(seqs, n_new, strict=True)
                if not s.page_ids and self.cache.pages_for_step(s, n)
            )
            ok = ok and need_sinks <= 3 - used + give_back
        before, protected = dict(self.cached), self.protected()
        if not ok:
            snap = self.snapshot()
            try:
                self.cache.begin_step(seqs, n_new)
            except OutOfPages:
                assert self.snapshot() == snap
                event("out of pages")
                return
            raise AssertionError("begin_step without room did not raise OutOfPages")
        starts = [s.ring_start for s in seqs]
        batch = self.cache.begin_step(seqs, n_new)
        self.check_evictions(before, protected, max(need - free, 0))
        parts = [
            self.data.span(s.extra_key, s.token_ids, s.length, s.length + n)
            for s, n in zip(seqs, n_new, strict=True)
        ]
        q, k, v = (torch.cat([p[i] for p in parts]) for i in range(3))
        out = self.cache.attention(0, batch, q, k, v, SCALE)
        row = 0
        for s, n in zip(seqs, n_new, strict=True):
            _, kk, vv = self.data.span(s.extra_key, s.token_ids, 0, s.length + n)
            ref = dense_attention(q[row : row + n], kk, vv, s.length, SCALE)
            assert torch.allclose(out[row : row + n].double(), ref, rtol=1e-5, atol=1e-5), (s.length, n)
            row += n
        self.cache.end_step(batch)
        window = self.cache.recent_window
        for s, start in zip(seqs, starts, strict=True):
            assert s.ring_start == max(start, s.cached_tokens, (s.length - window) // P * P)

    def _insert(self, r: RefSeq) -> None:
        s = r.seq
        n_full = s.length // P
        if n_full > r.locked:
            keys = page_keys(s.extra_key, s.token_ids, n_full)
            self.touch(keys)
            r.locked = n_full

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 10))
    def cache_prefix(self, i: int) -> None:
        r = self.seqs[i % len(self.seqs)]
        self.cache.cache_prefix(r.seq)
        self._insert(r)

    @precondition(lambda self: self.seqs)
    @rule(i=st.integers(0, 10), insert=st.booleans())
    def finish(self, i: int, insert: bool) -> None:
        r = self.seqs.pop(i % len(self.seqs))
        self.cache.finish(r.seq, insert=insert)
        if insert:
            self._insert(r)

    @rule(n=st.integers(1, 6))
    def evict(self, n: int) -> None:
        before, protected = dict(self.cached), self.protected()
        expect = min(n, self.evictable())
        freed = self.cache.evict(n)
        assert freed >= expect
        self.check_evictions(before, protected, expect)

    @precondition(lambda self: self.cached)
    @rule(data=st.data())
    def pin(self, data: st.DataObject) -> None:
        ns, toks = data.draw(st.sampled_from(sorted(self.cached, key=repr)))
        m = self.cache.match_prefix(list(toks), ns)
        assert m.tokens == len(toks)
        self.touch(page_keys(ns, toks, len(toks) // P))
        new = set(page_keys(ns, toks, len(toks) // P)) - self.pinned()
        if (len(self.pinned()) + len(new)) * self.page_bytes > self.cache.pin_budget_bytes:
            snap = self.snapshot()
            try:
                self.cache.pin(m.handle)
            except PinBudgetExceeded:
                assert self.snapshot() == snap
                event("pin over budget")
                return
            raise AssertionError("pin over budget did not raise")
        self.cache.pin(m.handle)
        self.pins.append((ns, toks))
        event("pinned")

    @precondition(lambda self: self.pins)
    @rule(i=st.integers(0, 10))
    def unpin(self, i: int) -> None:
        ns, toks = self.pins.pop(i % len(self.pins))
        m = self.cache.match_prefix(list(toks), ns)
        self.touch(page_keys(ns, toks, len(toks) // P))
        self.cache.unpin(m.handle)

    @rule(window=st.sampled_from([0, 2, 4]))
    def set_window(self, window: int) -> None:
        self.cache.set_recent_window(window)

    @precondition(lambda self: not self.seqs)
    @rule()
    def reset(self) -> None:
        self.cache.reset()
        self.cached.clear()
        self.pins.clear()
        self.content.clear()

    # ---- invariants -----------------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        self.cache.check_invariants()
        tree = self.tree_keys()
        assert set(tree) == set(self.cached), sorted(set(tree) ^ set(self.cached), key=repr)
        assert self.pinned() <= set(tree), "a pinned prefix left the tree"
        buf_k = self.cache.pool.k[0]["values"]
        buf_v = self.cache.pool.v[0]["values"]
        for key, page in tree.items():
            seen = self.content.get(key)
            if seen is None:
                self.content[key] = (page, buf_k[page].clone(), buf_v[page].clone())
            else:
                assert seen[0] == page, f"prefix {key} moved from page {seen[0]} to {page}"
                assert torch.equal(seen[1], buf_k[page]) and torch.equal(seen[2], buf_v[page]), (
                    f"tree page {page} changed"
                )
        stats = self.cache.stats()
        assert stats.tiers["cold"].cached == len(tree)
        assert stats.tiers["cold"].pinned == len(self.pinned())
        assert stats.running == len(self.seqs)


class SinkCacheMachine(CacheMachine):
    sinks = True
    block_pages = 1  # the block-wise online softmax, one page per block


SETTINGS = settings(
    max_examples=1000,
    stateful_step_count=10,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
TestCacheMachine = CacheMachine.TestCase
TestCacheMachine.settings = SETTINGS
TestSinkCacheMachine = SinkCacheMachine.TestCase
TestSinkCacheMachine.settings = SETTINGS
