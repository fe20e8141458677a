"""The radix tree alone: matching, splitting, insertion, references, LRU eviction, allocator."""

from __future__ import annotations

import pytest

from kvstrata.radix.allocator import IdAllocator
from kvstrata.radix.tree import RadixTree


def test_insert_reports_pages_already_present_and_match_splits_at_page_boundaries() -> None:
    t = RadixTree(page_size=2)
    assert t.insert([1, 2, 3, 4, 5, 6], [10, 11, 12]).present == 0
    res = t.insert([1, 2, 3, 4, 7, 8, 9], [20, 21, 22])  # 7 tokens: the 7th is not a whole page
    assert res.present == 2 and res.pages == [10, 11, 22]
    assert t.total_pages == 4 and t.evictable_pages == 4
    m = t.match_prefix([1, 2, 3, 9])
    assert m.pages == [10] and m.node is not None and m.node.tokens == (1, 2)
    assert t.match_prefix([1, 2, 3]).pages == [10]  # only whole pages match
    assert t.match_prefix([2, 1]).node is None


def test_split_keeps_the_handle_identity_and_its_references() -> None:
    t = RadixTree(page_size=1)
    h = t.insert([1, 2, 3, 4], [1, 2, 3, 4]).node
    t.lock(h)
    t.pin(h)
    upper = t.match_prefix([1, 2]).node
    assert upper is not h and h.parent is upper and h.tokens == (3, 4)
    assert (upper.lock_ref, upper.pin_ref, upper.own_locks) == (1, 1, 0)
    assert t.evictable_pages == 0 and t.pinned_pages == 4
    t.unlock(h)
    t.unpin(h)
    assert t.evictable_pages == 4 and t.pinned_pages == 0
    with pytest.raises(ValueError, match="holds no lock"):
        t.unlock(h)


def test_evict_takes_unlocked_leaves_lru_first_and_then_their_parents() -> None:
    t = RadixTree(page_size=1)
    a = t.insert([1, 2, 3], [1, 2, 3]).node  # clock 1
    t.insert([1, 2, 4], [1, 2, 4])  # clock 2: splits, [4] is a sibling of [3]
    t.insert([5], [5])  # clock 3
    t.lock(a)
    assert t.evict(1) == [4]
    assert t.evict(10) == [5]  # [1, 2] and [3] are locked through a
    t.unlock(a)
    assert t.evict(1) == [3]
    assert t.evict(1) == [1, 2]
    assert t.total_pages == t.evictable_pages == 0


def test_reset_returns_every_page() -> None:
    t = RadixTree(page_size=1)
    t.insert([1, 2], [1, 2])
    t.insert([1, 3], [1, 3], extra_key="ns")
    assert sorted(t.reset()) == [1, 1, 2, 3]
    assert t.match_prefix([1]).node is None and t.total_pages == 0


def test_evicting_a_namespace_empties_and_drops_its_root() -> None:
    t = RadixTree(page_size=1)
    for image in range(50):
        t.insert([7, 8], [2 * image, 2 * image + 1], extra_key=f"img-{image}")
    t.insert([1], [100])
    assert len(t.roots()) == 51
    assert len(t.evict(2 * 50 + 1)) == 101
    assert t.roots() == {} and t.total_pages == 0
    t.insert([7], [5], extra_key="img-0")
    assert t.match_prefix([7], extra_key="img-0").pages == [5]


def test_allocator_is_lifo_and_refuses_double_frees() -> None:
    a = IdAllocator(4, "pages")
    assert a.alloc(3) == [0, 1, 2]
    a.free([1])
    assert a.alloc(1) == [1] and a.num_free == 1
    with pytest.raises(ValueError, match="id 3 freed twice"):
        a.free([3])
    with pytest.raises(ValueError, match="asked for 2, 1 free"):
        a.alloc(2)
    assert a.check() == []
