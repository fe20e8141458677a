"""`check_invariants`: DESIGN.md's invariants, recomputed from scratch, raising with precise messages."""

from __future__ import annotations

import zlib
from collections import Counter
from typing import TYPE_CHECKING

import torch

from kvstrata.radix.errors import InvariantViolation
from kvstrata.radix.pool import ColdPool, as_raw
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
    if cache.image_pool is not None:
        errors += cache.image_pool.allocator.check()
    if cache.raised_pool is not None:
        errors += cache.raised_pool.allocator.check()
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
    freed_held = sorted(p for p in holders if cache.page_is_free(p))
    if freed_held:
        errors.append(f"cold pages {freed_held[:8]} are free but still held")
    for pool, base, name in _pools(cache):
        used = sum(1 for p in holders if cache.pool_of(p)[2] == name)
        if used != pool.allocator.num_used:
            errors.append(
                f"{pool.allocator.num_used} {name} pages allocated but {used} held: leaked or double-counted"
            )
        stale = [
            base + i
            for i in range(pool.allocator.total)
            if pool.allocator.is_free(i) and cache.written[base + i]
        ]
        if stale:
            errors.append(f"free pages {stale[:8]} still marked written")
    if cache.tree.total_pages != len(tree_pages):
        errors.append(f"tree counts {cache.tree.total_pages} pages, its nodes hold {len(tree_pages)}")
    image_pages = sum(1 for p in tree_pages if cache.is_image_page(p))
    if cache.tree.image_pages != image_pages:
        errors.append(f"tree counts {cache.tree.image_pages} image pages, its nodes hold {image_pages}")
    misplaced = [n.pages[:3] for n in cache.tree.nodes() if n.image != cache.tree.count_image(n.pages)]
    if misplaced:
        errors.append(f"nodes {misplaced[:4]} count their image pages wrong")
    errors += _image_pages_hold_images(cache, tree_pages)
    unwritten = sorted(p for p in tree_pages if not cache.written[p])
    if unwritten:
        errors.append(f"tree pages {unwritten[:8]} were never written (a tree page must be complete)")
    if cache.sinks is not None:
        errors += _sinks(cache, tree_pages)
    return errors


def _pools(cache: StratifiedKVCache) -> list[tuple[ColdPool, int, str]]:
    """(pool, first page id, name) of the text pool and, if there are, the image and raised pools."""
    pools = [(cache.pool, 0, "cold")]
    if cache.raised_pool is not None:
        pools.append((cache.raised_pool, cache.raised_base, "raised"))
    if cache.image_pool is not None:
        pools.append((cache.image_pool, cache.image_base, "image"))
    return pools


def _image_pages_hold_images(cache: StratifiedKVCache, tree_pages: set[int]) -> list[str]:
    """A tree page is in the image pool exactly when its tokens hold an image token."""
    floor = cache.cfg.image_token_from
    if cache.image_pool is None or floor is None:
        return []
    P, wrong = cache.page_size, []
    for node in cache.tree.nodes():
        for i, page in enumerate(node.pages):
            if (max(node.tokens[i * P : (i + 1) * P]) >= floor) != cache.is_image_page(page):
                wrong.append(page)
    return [f"tree pages {wrong[:8]} are in the wrong pool for their tokens"] if wrong else []


def _sinks(cache: StratifiedKVCache, tree_pages: set[int]) -> list[str]:
    assert cache.sinks is not None
    errors = []
    bound = cache.sinks.of_page
    if len(set(bound.values())) != len(bound):
        errors.append("two cold pages share one sink page")
    if len(bound) != cache.sinks.allocator.num_used:
        errors.append(f"{len(bound)} sinks bound but {cache.sinks.allocator.num_used} sink pages used")
    unowned = sorted(p for p in bound if cache.page_is_free(p))
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
    pinned_image = sum(n.image for n in nodes if n.pin_ref > 0)
    if pinned_image != cache.tree.pinned_image_pages:
        errors.append(
            f"tree counts {cache.tree.pinned_image_pages} pinned image pages, nodes hold {pinned_image}"
        )
    pinned_bytes = cache.page_ids_bytes([p for n in nodes if n.pin_ref > 0 for p in n.pages])
    if pinned_bytes != cache.pinned_bytes:
        errors.append(
            f"cache reports {cache.pinned_bytes} pinned bytes, its pinned pages hold {pinned_bytes}"
        )
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
    actual = {name: _buffer_bytes(pool) - pool.padding_bytes for pool, _, name in _pools(cache)}
    actual["ring"] = cache.ring.k.nbytes + cache.ring.v.nbytes - cache.ring.padding_bytes
    if cache.sinks is not None:
        actual["sink"] = cache.sinks.k.nbytes + cache.sinks.v.nbytes - cache.sinks.padding_bytes
    # Used pages counted from their holders, not from the allocator that reports ``free``.
    tree_nodes = list(cache.tree.nodes())
    held = {p for n in tree_nodes for p in n.pages} | {
        p for s in cache.running.values() for p in s.private_pages
    }
    slot_pages = cache.ring.capacity // cache.page_size
    first_nodes = [n for n in tree_nodes if n.parent is not None and n.parent.is_root]
    in_tree = [p for n in tree_nodes for p in n.pages]
    free_tree = [p for n in tree_nodes if not n.protected for p in n.pages]
    counted, evictable = {"ring": (len(cache.running) * slot_pages, 0)}, {"ring": 0}
    for _, _, name in _pools(cache):
        counted[name] = (
            sum(1 for p in held if cache.pool_of(p)[2] == name),
            sum(1 for p in in_tree if cache.pool_of(p)[2] == name),
        )
        evictable[name] = sum(1 for p in free_tree if cache.pool_of(p)[2] == name)
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


def _buffer_bytes(pool: ColdPool) -> int:
    return sum(t.nbytes for bufs in (*pool.k, *pool.v) for t in bufs.values())


def _padding_rows(cache: StratifiedKVCache) -> list[str]:
    """The zero rows that batch padding reads must still be zero: a write there would leak into
    every padded batch."""
    rows = [
        (f"{tier} {kind} {name}", buf[pool.null_page])
        for pool, _, tier in _pools(cache)
        for kind, layers in (("k", pool.k), ("v", pool.v))
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
    tree_pages = {p for n in cache.tree.nodes() for p in n.pages}
    errors = []
    for pool, base, name in _pools(cache):
        pages = sorted(p for p in tree_pages if cache.pool_of(p)[2] == name)
        errors += _check_checksums(cache, pool, pages, base)
    return errors


def _check_checksums(cache: StratifiedKVCache, pool: ColdPool, pages: list[int], base: int) -> list[str]:
    """Compare ``pages`` (ids; row ``id - base`` of ``pool``) with their recorded checksums."""
    if not pages:
        return []
    index = torch.tensor([p - base for p in pages], dtype=torch.long, device=cache.device)
    sums = [0] * len(pages)
    for bufs in (*pool.k, *pool.v):
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
