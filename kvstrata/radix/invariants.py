"""`check_invariants`: DESIGN.md's invariants, recomputed from scratch, raising with precise messages."""

from __future__ import annotations

import zlib
from collections import Counter
from typing import TYPE_CHECKING

import torch

from kvstrata.radix.errors import InvariantViolation
from kvstrata.radix.pool import as_raw
from kvstrata.radix.tree import TreeNode

if TYPE_CHECKING:
    from kvstrata.radix.cache import StratifiedKVCache


def check_invariants(cache: StratifiedKVCache) -> None:
    errors = (
        _allocators(cache)
        + _tree(cache)
        + _ownership(cache)
        + _sequences(cache)
        + _pins_and_eviction(cache)
        + _bytes(cache)
        + _padding_rows(cache)
        + _immutable_tree_pages(cache)
    )
    if errors:
        raise InvariantViolation("cache invariants violated:\n  " + "\n  ".join(errors))


def _allocators(cache: StratifiedKVCache) -> list[str]:
    errors = cache.pool.allocator.check() + cache.ring.slots.check()
    if cache.sinks is not None:
        errors += cache.sinks.allocator.check()
    return errors


def _tree(cache: StratifiedKVCache) -> list[str]:
    errors = []
    P = cache.page_size
    for key, root in cache.tree.roots().items():
        if root.pages or root.parent is not None:
            errors.append(f"namespace root {key!r} holds pages or has a parent")
        errors += _refs(root, root_ok=True)
    for node in cache.tree.nodes():
        name = f"node {node.pages[:3]}..." if node.pages else "node with no pages"
        parent = node.parent
        assert parent is not None
        if not node.pages or len(node.tokens) != len(node.pages) * P:
            errors.append(f"{name}: {len(node.tokens)} tokens for {len(node.pages)} pages of {P}")
        if parent.children.get(node.tokens[:P]) is not node:
            errors.append(f"{name}: not its parent's child under its first page")
        if node.evicted:
            errors.append(f"{name}: marked evicted but still in the tree")
        if not parent.is_root and parent.last_access < node.last_access:
            errors.append(f"{name}: used at {node.last_access}, after its parent ({parent.last_access})")
        errors += _refs(node, root_ok=False)
    return errors


def _refs(node: TreeNode, root_ok: bool) -> list[str]:
    errors = []
    for kind in ("lock", "pin"):
        ref = getattr(node, f"{kind}_ref")
        expect = getattr(node, f"own_{kind}s") + sum(
            getattr(c, f"{kind}_ref") for c in node.children.values()
        )
        if ref != expect and not root_ok:
            errors.append(f"node {node.pages[:3]}: {kind}_ref {ref} != own {kind}s + children's = {expect}")
        if ref < 0:
            errors.append(f"node {node.pages[:3]}: negative {kind}_ref {ref}")
    return errors


def _ownership(cache: StratifiedKVCache) -> list[str]:
    errors = []
    holders: Counter[int] = Counter()
    for node in cache.tree.nodes():
        holders.update(node.pages)
    tree_pages = set(holders)
    for seq in cache.running.values():
        holders.update(seq.private_pages)
    twice = sorted(p for p, c in holders.items() if c > 1)
    if twice:
        errors.append(f"cold pages {twice[:8]} held twice (tree node and/or sequences)")
    alloc = cache.pool.allocator
    freed_held = sorted(p for p in holders if alloc.is_free(p))
    if freed_held:
        errors.append(f"cold pages {freed_held[:8]} are free but still held")
    if len(holders) != alloc.num_used:
        errors.append(
            f"{alloc.num_used} cold pages allocated but {len(holders)} held: leaked or double-counted"
        )
    if cache.tree.total_pages != len(tree_pages):
        errors.append(f"tree counts {cache.tree.total_pages} pages, its nodes hold {len(tree_pages)}")
    unwritten = sorted(p for p in tree_pages if not cache.written[p])
    if unwritten:
        errors.append(f"tree pages {unwritten[:8]} were never written (a tree page must be complete)")
    stale = [p for p in range(alloc.total) if alloc.is_free(p) and cache.written[p]]
    if stale:
        errors.append(f"free pages {stale[:8]} still marked written")
    if cache.sinks is not None:
        errors += _sinks(cache, tree_pages)
    return errors


def _sinks(cache: StratifiedKVCache, tree_pages: set[int]) -> list[str]:
    assert cache.sinks is not None
    errors = []
    bound = cache.sinks.of_page
    if len(set(bound.values())) != len(bound):
        errors.append("two cold pages share one sink page")
    if len(bound) != cache.sinks.allocator.num_used:
        errors.append(f"{len(bound)} sinks bound but {cache.sinks.allocator.num_used} sink pages used")
    unowned = sorted(p for p in bound if cache.pool.allocator.is_free(p))
    if unowned:
        errors.append(f"sinks bound to free cold pages {unowned[:8]}")
    firsts = [n.pages[0] for root in cache.tree.roots().values() for n in root.children.values()]
    firsts += [s.page_ids[0] for s in cache.running.values() if s.page_ids]
    missing = sorted(p for p in firsts if p not in bound)
    if missing:
        errors.append(f"first pages {missing[:8]} have no sink page")
    extra = sorted(set(bound) - set(firsts))
    if extra:
        errors.append(f"sinks bound to pages {extra[:8]} that are no sequence's first page")
    return errors


def _sequences(cache: StratifiedKVCache) -> list[str]:
    errors = []
    P, cap = cache.page_size, cache.ring.capacity
    own_locks: Counter[int] = Counter()
    slots = [s.slot for s in cache.running.values()]
    if len(set(slots)) != len(slots):
        errors.append(f"ring slots shared by running sequences: {sorted(slots)}")
    if len(slots) != cache.ring.slots.num_used:
        errors.append(f"{cache.ring.slots.num_used} ring slots used, {len(slots)} running sequences")
    for seq in cache.running.values():
        name = f"sequence {seq.seq_id}"
        if cache.ring.slots.is_free(seq.slot):
            errors.append(f"{name}: its ring slot {seq.slot} is free")
        expect_pages = seq.length // P
        if len(seq.page_ids) != expect_pages and not seq.in_step:
            errors.append(f"{name}: {len(seq.page_ids)} pages for {seq.length} tokens (want {expect_pages})")
        if not (seq.cached_tokens <= seq.ring_start <= seq.length) or seq.ring_start % P:
            errors.append(f"{name}: ring_start {seq.ring_start} outside [{seq.cached_tokens}, {seq.length}]")
        if seq.length - seq.ring_start > cap - 1:
            errors.append(f"{name}: ring holds {seq.length - seq.ring_start} tokens, capacity {cap}")
        if seq.handle is None:
            if seq.tree_pages:
                errors.append(f"{name}: {seq.tree_pages} tree pages but no handle")
        else:
            own_locks[id(seq.handle)] += 1
            path = [p for n in reversed(list(seq.handle.path())) for p in n.pages]
            if seq.handle.evicted or path != seq.page_ids[: seq.tree_pages]:
                errors.append(f"{name}: its first {seq.tree_pages} pages are not its handle's tree path")
        unwritten = [p for p in seq.page_ids[: seq.length // P] if not cache.written[p]]
        if unwritten and not seq.in_step:
            errors.append(f"{name}: full pages {unwritten[:8]} were never written")
    for node in cache.tree.nodes():
        holding = own_locks.get(id(node), 0)
        if node.own_locks != holding:
            errors.append(f"node {node.pages[:3]}: {node.own_locks} locks, {holding} sequences hold it")
    return errors


def _pins_and_eviction(cache: StratifiedKVCache) -> list[str]:
    errors = []
    nodes = list(cache.tree.nodes())
    pinned = sum(len(n.pages) for n in nodes if n.pin_ref > 0)
    evictable = sum(len(n.pages) for n in nodes if not n.protected)
    if pinned != cache.tree.pinned_pages:
        errors.append(f"tree counts {cache.tree.pinned_pages} pinned pages, nodes hold {pinned}")
    if evictable != cache.tree.evictable_pages:
        errors.append(f"tree counts {cache.tree.evictable_pages} evictable pages, nodes hold {evictable}")
    firsts = [n for n in nodes if n.parent is not None and n.parent.is_root]
    free_firsts = sum(1 for n in firsts if not n.protected)
    if (len(firsts), free_firsts) != (cache.tree.first_nodes, cache.tree.evictable_first_nodes):
        errors.append(
            f"tree counts {cache.tree.first_nodes} first nodes ({cache.tree.evictable_first_nodes} "
            f"evictable), it has {len(firsts)} ({free_firsts})"
        )
    pinned_bytes = pinned * cache.pool.page_bytes
    if pinned_bytes > cache.pin_budget_bytes:
        errors.append(f"{pinned_bytes} pinned bytes exceed the pin budget of {cache.pin_budget_bytes}")
    for node in nodes:
        if (
            node.protected
            and node.parent is not None
            and not node.parent.is_root
            and not node.parent.protected
        ):
            errors.append(f"node {node.pages[:3]} is locked/pinned but its parent is evictable")
    return errors


def _bytes(cache: StratifiedKVCache) -> list[str]:
    errors = []
    stats = cache.stats()
    # What the buffers hold, less the one zero row each store keeps for padding.
    pool_buffers = sum(t.nbytes for bufs in (*cache.pool.k, *cache.pool.v) for t in bufs.values())
    actual = {
        "cold": pool_buffers - cache.pool.padding_bytes,
        "ring": cache.ring.k.nbytes + cache.ring.v.nbytes - cache.ring.padding_bytes,
    }
    if cache.sinks is not None:
        actual["sink"] = cache.sinks.k.nbytes + cache.sinks.v.nbytes - cache.sinks.padding_bytes
    # Used pages counted from their holders, not from the allocator that reports ``free``.
    tree_nodes = list(cache.tree.nodes())
    held = {p for n in tree_nodes for p in n.pages} | {
        p for s in cache.running.values() for p in s.private_pages
    }
    slot_pages = cache.ring.capacity // cache.page_size
    first_nodes = [n for n in tree_nodes if n.parent is not None and n.parent.is_root]
    counted = {
        "cold": (len(held), sum(len(n.pages) for n in tree_nodes)),
        "ring": (len(cache.running) * slot_pages, 0),
    }
    evictable = {"cold": sum(len(n.pages) for n in tree_nodes if not n.protected), "ring": 0}
    if cache.sinks is not None:
        counted["sink"] = (len(cache.sinks.of_page), len(first_nodes))
        evictable["sink"] = sum(1 for n in first_nodes if not n.protected)
    for name, tier in stats.tiers.items():
        used, cached = counted[name]
        if tier.free + used != tier.total:
            errors.append(f"tier {name}: free {tier.free} + {used} held by owners != total {tier.total}")
        if tier.used != used or tier.cached != cached:
            errors.append(
                f"tier {name}: reports used {tier.used}, cached {tier.cached}; owners hold {used}, "
                f"the tree {cached}"
            )
        if tier.evictable != evictable[name]:
            errors.append(f"tier {name}: reports {tier.evictable} evictable, the tree has {evictable[name]}")
        if tier.bytes("total") != actual[name]:
            errors.append(f"tier {name}: reports {tier.bytes('total')} bytes, buffers hold {actual[name]}")
        if tier.cached > tier.used or tier.pinned > tier.cached:
            errors.append(
                f"tier {name}: pinned {tier.pinned} <= cached {tier.cached} <= used {tier.used} broken"
            )
    return errors


def _padding_rows(cache: StratifiedKVCache) -> list[str]:
    """The zero rows that batch padding reads must still be zero: a write there would leak into
    every padded batch."""
    rows = [
        (f"cold {kind} {name}", buf[cache.pool.null_page])
        for kind, layers in (("k", cache.pool.k), ("v", cache.pool.v))
        for bufs in layers
        for name, buf in bufs.items()
    ]
    rows += [
        ("ring k", cache.ring.k[:, cache.ring.null_row]),
        ("ring v", cache.ring.v[:, cache.ring.null_row]),
    ]
    if cache.sinks is not None:
        rows += [
            ("sink k", cache.sinks.k[:, cache.sinks.null_slot]),
            ("sink v", cache.sinks.v[:, cache.sinks.null_slot]),
        ]
    return [f"{name}: the padding row was written" for name, row in rows if bool(as_raw(row).any())]


def _immutable_tree_pages(cache: StratifiedKVCache) -> list[str]:
    """Tree pages never change: each one's checksum over every layer's buffers, recorded the first
    time a check sees it in the tree, must hold at every later check (until the page is freed)."""
    pages = sorted({p for n in cache.tree.nodes() for p in n.pages})
    if not pages:
        return []
    index = torch.tensor(pages, dtype=torch.long, device=cache.device)
    sums = [0] * len(pages)
    for bufs in (*cache.pool.k, *cache.pool.v):
        for buf in bufs.values():
            rows = as_raw(buf).index_select(0, index).cpu().contiguous().view(torch.uint8)
            rows = rows.reshape(len(pages), -1).numpy()
            sums = [zlib.crc32(rows[i].tobytes(), sums[i]) for i in range(len(pages))]
    errors = []
    for page, crc in zip(pages, sums, strict=True):
        seen = cache.page_checksums.setdefault(page, crc)
        if seen != crc:
            errors.append(
                f"tree page {page} changed after it entered the tree (checksum {seen:#x} -> {crc:#x})"
            )
    return errors
