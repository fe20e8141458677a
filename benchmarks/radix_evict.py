"""Eviction from a radix tree holding 100K cached pages: the kept heap vs a heap rebuilt per call.

The tree holds ``--pages`` pages in leaves of ``--leaf-pages`` pages under a few shared trunks
(prefixes of 8 pages), as a warm prefix cache does. Each round touches a random cached prefix (an
admission's match) and then evicts one leaf (a step that needs a page), so the LRU order keeps
changing. The baseline is the previous algorithm, measured in the same run on an identical tree:
collect every evictable leaf, heapify, pop. Prints microseconds per evict call and the ratio.
``python benchmarks/radix_evict.py --pages 100000 --rounds 2000``
"""

from __future__ import annotations

import argparse
import heapq
import random
import time
from collections.abc import Callable

from kvstrata.radix.tree import RadixTree, TreeNode

PAGE = 16


def build(pages: int, leaf_pages: int, seed: int) -> tuple[RadixTree, list[list[int]]]:
    tree = RadixTree(PAGE)
    rng = random.Random(seed)
    trunks = [[rng.randrange(1 << 30) for _ in range(8 * PAGE)] for _ in range(16)]
    keys, next_page = [], 0
    while next_page + leaf_pages <= pages:
        trunk = trunks[len(keys) % len(trunks)]
        tail = [rng.randrange(1 << 30) for _ in range(leaf_pages * PAGE)]
        key = trunk + tail
        n = len(key) // PAGE
        res = tree.insert(key, list(range(next_page, next_page + n)))
        next_page += n - res.present
        keys.append(key)
    return tree, keys


def rebuild_heap_evict(tree: RadixTree, need: int) -> list[int]:
    """The previous ``RadixTree.evict``: a heap over every evictable leaf, built on each call."""
    heap = [(n.last_access, i, n) for i, n in enumerate(tree.nodes()) if _leaf(n)]
    heapq.heapify(heap)
    tie, freed, got = len(heap), [], 0
    while got < need and heap:
        _, _, node = heapq.heappop(heap)
        got += len(node.pages)
        freed.extend(node.pages)
        parent = node.parent
        assert parent is not None
        del parent.children[node.tokens[:PAGE]]
        node.evicted = True
        tree.total_pages -= len(node.pages)
        tree.evictable_pages -= len(node.pages)
        if _leaf(parent):
            tie += 1
            heapq.heappush(heap, (parent.last_access, tie, parent))
    return freed


def _leaf(n: TreeNode) -> bool:
    return n.parent is not None and not n.children and not n.protected


def run(tree: RadixTree, keys: list[list[int]], evict: Callable[[int], list[int]], rounds: int) -> float:
    rng = random.Random(1)
    spent = 0.0
    for _ in range(rounds):
        tree.match_prefix(keys[rng.randrange(len(keys))])
        t0 = time.perf_counter()
        evict(1)
        spent += time.perf_counter() - t0
    return spent / rounds * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pages", type=int, default=100_000)
    ap.add_argument("--leaf-pages", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=2000)
    args = ap.parse_args()
    kept_tree, keys = build(args.pages, args.leaf_pages, seed=0)
    base_tree, _ = build(args.pages, args.leaf_pages, seed=0)
    print(f"tree: {kept_tree.total_pages:,} cached pages in {kept_tree.num_nodes:,} nodes")
    kept = run(kept_tree, keys, kept_tree.evict, args.rounds)
    base = run(base_tree, keys, lambda need: rebuild_heap_evict(base_tree, need), args.rounds)
    print(f"evict(1) after a match, {args.rounds} rounds:")
    print(f"  heap rebuilt per call (previous): {base:10.1f} us")
    print(f"  kept heap (now):                  {kept:10.1f} us")
    print(f"  ratio previous / now:             {base / kept:10.1f}x")


if __name__ == "__main__":
    main()
