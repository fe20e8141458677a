"""`RadixTree`: page-aligned token prefixes -> cold page ids, with locks, pins and LRU eviction.

Keys are token ids cut into pages of ``page_size``; each node holds a run of whole pages. An
``extra_key`` (image hash, adapter name) selects a separate namespace root, so equal tokens under
different namespaces never share pages. ``lock_ref`` and ``pin_ref`` count locks/pins on a node or
any descendant (a lock on a node protects its whole path to the root). Only nodes with both at 0
are evictable, and only leaves are evicted, least recently used first. Timestamps come from a
logical clock, so a parent is never older than its children.

With ``image_from`` set, page ids from ``image_from`` on are image pages (stored in a pool of their
own, `StratifiedKVCache.image_pool`): each node counts its own (``image``) and the tree keeps the
image part of its page counters (``image_pages``, ``evictable_image_pages``, ``pinned_image_pages``).

Eviction keeps one heap of candidate leaves across calls, keyed by last use. An entry is pushed
whenever a node may have become an evictable leaf or was used again (insert, unlock/unpin, a
match that touches it, its last child evicted); stale entries (evicted, protected, no longer a
leaf, or used since) are skipped when popped, and the heap is rebuilt only when stale entries
outnumber the nodes. An eviction costs O(log n) per leaf it takes, not a pass over the tree.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple


@dataclass(eq=False)
class TreeNode:
    tokens: tuple[int, ...]
    pages: list[int]
    parent: TreeNode | None
    children: dict[tuple[int, ...], TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    own_locks: int = 0
    pin_ref: int = 0
    own_pins: int = 0
    last_access: int = 0
    evicted: bool = False
    image: int = 0  # how many of ``pages`` are image pages (see ``RadixTree.image_from``)

    @property
    def is_root(self) -> bool:
        return self.parent is None

    @property
    def protected(self) -> bool:
        return self.lock_ref > 0 or self.pin_ref > 0

    def path(self) -> Iterator[TreeNode]:
        """This node and its ancestors, root excluded."""
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            yield node
            node = node.parent


class TreeMatch(NamedTuple):
    pages: list[int]
    node: TreeNode | None  # None when nothing matched


class TreeInsert(NamedTuple):
    present: int  # leading pages that were already in the tree
    pages: list[int]  # the tree's page ids for the whole key
    node: TreeNode | None


class RadixTree:
    def __init__(self, page_size: int, image_from: int | None = None) -> None:
        self.page_size = page_size
        self.image_from = image_from
        self.image_pages = self.evictable_image_pages = self.pinned_image_pages = 0
        self._roots: dict[Hashable, TreeNode] = {}
        self._clock = 0
        self.total_pages = 0
        self.evictable_pages = 0
        self.pinned_pages = 0
        # Nodes that start at position 0 (children of a namespace root), all and unprotected ones:
        # with attention sinks each holds one sink page.
        self.first_nodes = 0
        self.evictable_first_nodes = 0
        self.num_nodes = 0
        self._heap: list[tuple[int, int, TreeNode]] = []  # (last_access, push order, leaf)
        self._pushes = 0

    def _root(self, extra_key: Hashable, create: bool) -> TreeNode | None:
        root = self._roots.get(extra_key)
        if root is None and create:
            root = self._roots[extra_key] = TreeNode((), [], None)
        return root

    def count_image(self, pages: Sequence[int]) -> int:
        """How many of ``pages`` are image pages."""
        if self.image_from is None:
            return 0
        return sum(1 for p in pages if p >= self.image_from)

    def _page_key(self, tokens: Sequence[int], start: int) -> tuple[int, ...]:
        return tuple(tokens[start : start + self.page_size])

    def _common_pages(self, node: TreeNode, tokens: Sequence[int], start: int) -> int:
        """How many of ``node``'s pages equal ``tokens[start:]``, page by page."""
        p = self.page_size
        n = min(len(node.pages), (len(tokens) - start) // p)
        if node.tokens[: n * p] == tuple(tokens[start : start + n * p]):
            return n
        for i in range(n):
            if node.tokens[i * p : (i + 1) * p] != tuple(tokens[start + i * p : start + (i + 1) * p]):
                return i
        return n

    def _split(self, node: TreeNode, n_pages: int) -> TreeNode:
        """Cut ``node`` after ``n_pages``; returns the new upper node. ``node`` keeps its identity
        (so handles stay valid) and becomes the lower part; counters do not change."""
        assert node.parent is not None and 0 < n_pages < len(node.pages)
        cut = n_pages * self.page_size
        self.num_nodes += 1
        upper = TreeNode(
            tokens=node.tokens[:cut],
            pages=node.pages[:n_pages],
            parent=node.parent,
            lock_ref=node.lock_ref,
            pin_ref=node.pin_ref,
            last_access=node.last_access,
        )
        upper.image = self.count_image(upper.pages)
        node.image -= upper.image
        node.parent.children[node.tokens[: self.page_size]] = upper
        node.tokens, node.pages, node.parent = node.tokens[cut:], node.pages[n_pages:], upper
        upper.children[node.tokens[: self.page_size]] = node
        return upper

    def _walk(self, root: TreeNode, tokens: Sequence[int]) -> tuple[TreeNode, list[int], int]:
        """Follow ``tokens`` from ``root``, splitting a node where the match ends inside it.
        Returns the deepest matched node, its path's pages and the matched token count."""
        node, pages, pos = root, [], 0
        while pos + self.page_size <= len(tokens):
            child = node.children.get(self._page_key(tokens, pos))
            if child is None:
                break
            common = self._common_pages(child, tokens, pos)
            if common < len(child.pages):
                child = self._split(child, common)
            pages.extend(child.pages)
            pos += common * self.page_size
            node = child
        return node, pages, pos

    def _touch(self, node: TreeNode) -> None:
        self._clock += 1
        for n in node.path():
            n.last_access = self._clock
        self._offer(node)  # only the deepest node of the path can be a leaf

    def _offer(self, node: TreeNode) -> None:
        """Push ``node`` as an eviction candidate if it is an evictable leaf now."""
        if not self._evictable_leaf(node):
            return
        if len(self._heap) > 2 * self.num_nodes + 64:  # mostly stale entries: start afresh
            self._heap = []
            for n in self.nodes():
                if self._evictable_leaf(n):
                    self._push(n)
            return
        self._push(node)

    def _push(self, node: TreeNode) -> None:
        self._pushes += 1
        heapq.heappush(self._heap, (node.last_access, self._pushes, node))

    def match_prefix(self, tokens: Sequence[int], extra_key: Hashable = None) -> TreeMatch:
        """Longest cached page-aligned prefix of ``tokens``; marks its path as used now."""
        root = self._root(extra_key, create=False)
        if root is None:
            return TreeMatch([], None)
        node, pages, _ = self._walk(root, tokens)
        if node is root:
            return TreeMatch([], None)
        self._touch(node)
        return TreeMatch(pages, node)

    def insert(self, tokens: Sequence[int], pages: Sequence[int], extra_key: Hashable = None) -> TreeInsert:
        """Insert whole pages ``tokens[: len(pages) * page_size]`` -> ``pages``.

        The tree takes ownership of ``pages[present:]``; the caller frees its duplicates of the
        ``present`` leading pages, which the tree already held (their ids are in ``result.pages``).
        """
        n = len(pages) * self.page_size
        if len(tokens) < n:
            raise ValueError(f"insert: {len(pages)} pages need {n} tokens, got {len(tokens)}")
        tokens = tokens[:n]
        if not pages:
            return TreeInsert(0, [], None)
        root = self._root(extra_key, create=True)
        assert root is not None
        node, tree_pages, pos = self._walk(root, tokens)
        present = len(tree_pages)
        if pos < n:
            leaf = TreeNode(tuple(tokens[pos:]), list(pages[present:]), node)
            node.children[leaf.tokens[: self.page_size]] = leaf
            self.num_nodes += 1
            leaf.image = self.count_image(leaf.pages)
            self.total_pages += len(leaf.pages)
            self.evictable_pages += len(leaf.pages)
            self.image_pages += leaf.image
            self.evictable_image_pages += leaf.image
            if node.is_root:
                self.first_nodes += 1
                self.evictable_first_nodes += 1
            tree_pages.extend(leaf.pages)
            node = leaf
        self._touch(node)
        return TreeInsert(present, tree_pages, node)

    def lock(self, node: TreeNode | None) -> None:
        self._add_ref(node, "lock", +1)

    def unlock(self, node: TreeNode | None) -> None:
        self._add_ref(node, "lock", -1)

    def pin(self, node: TreeNode | None) -> None:
        self._add_ref(node, "pin", +1)

    def unpin(self, node: TreeNode | None) -> None:
        self._add_ref(node, "pin", -1)

    def unpinned_pages_on_path(self, node: TreeNode) -> tuple[int, int]:
        """Pages that pinning ``node`` would newly pin: (all, of which image pages)."""
        path = [n for n in node.path() if n.pin_ref == 0]
        return sum(len(n.pages) for n in path), sum(n.image for n in path)

    def _add_ref(self, node: TreeNode | None, kind: str, delta: int) -> None:
        if node is None:
            return
        if node.evicted:
            raise ValueError(f"{kind}: the handle's node was evicted")
        own = f"own_{kind}s"
        if delta < 0 and getattr(node, own) == 0:
            raise ValueError(f"un{kind}: the handle holds no {kind}")
        setattr(node, own, getattr(node, own) + delta)
        ref = f"{kind}_ref"
        for n in node.path():
            was_protected = n.protected
            was_pinned = n.pin_ref > 0
            setattr(n, ref, getattr(n, ref) + delta)
            if was_protected != n.protected:
                self.evictable_pages += len(n.pages) if was_protected else -len(n.pages)
                self.evictable_image_pages += n.image if was_protected else -n.image
                if n.parent is not None and n.parent.is_root:
                    self.evictable_first_nodes += 1 if was_protected else -1
            if was_pinned != (n.pin_ref > 0):
                self.pinned_pages += -len(n.pages) if was_pinned else len(n.pages)
                self.pinned_image_pages += -n.image if was_pinned else n.image
            if was_protected and not n.protected:
                self._offer(n)

    def evict(self, need: int, weight: Callable[[TreeNode], int] | None = None) -> list[int]:
        """Evict unprotected leaves in LRU order until their summed ``weight`` (default: pages)
        reaches ``need`` or nothing evictable is left; returns the freed page ids."""
        weight = weight or (lambda node: len(node.pages))
        freed: list[int] = []
        got = 0
        while got < need and self._heap:  # (_offer below may rebuild the heap: no local alias)
            used, _, node = heapq.heappop(self._heap)
            if node.evicted or used != node.last_access or not self._evictable_leaf(node):
                continue  # stale: evicted, used again since, locked, pinned or no longer a leaf
            got += weight(node)
            freed.extend(node.pages)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[: self.page_size]]
            node.evicted = True
            self.num_nodes -= 1
            self.total_pages -= len(node.pages)
            self.evictable_pages -= len(node.pages)
            self.image_pages -= node.image
            self.evictable_image_pages -= node.image
            if parent.is_root:
                self.first_nodes -= 1
                self.evictable_first_nodes -= 1
            if parent.is_root and not parent.children:
                # A namespace (image hash, adapter) whose last page went: forget its root too.
                self._roots = {key: root for key, root in self._roots.items() if root is not parent}
            self._offer(parent)
        return freed

    @staticmethod
    def _evictable_leaf(node: TreeNode) -> bool:
        return node.parent is not None and not node.children and not node.protected

    def nodes(self) -> Iterator[TreeNode]:
        """Every non-root node, parents before children."""
        stack = [c for root in self._roots.values() for c in root.children.values()]
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def roots(self) -> dict[Hashable, TreeNode]:
        return dict(self._roots)

    def reset(self) -> list[int]:
        """Drop every node (locks and pins included); returns all page ids the tree held."""
        pages = []
        for node in self.nodes():
            node.evicted = True
            pages.extend(node.pages)
        self._roots.clear()
        self.total_pages = self.evictable_pages = self.pinned_pages = 0
        self.image_pages = self.evictable_image_pages = self.pinned_image_pages = 0
        self.first_nodes = self.evictable_first_nodes = self.num_nodes = 0
        self._heap = []
        return pages
