"""kvstrata's cache invariants checked on a `KvstrataRadixCache` and SGLang's allocator.

- Tree shape: each child hangs under the key it starts with; values are whole pages of slots.
- Every allocatable page is free, held by exactly one tree node, or held by a running request
  (``held_slots``), exactly once: free + used = total.
- Lock references: a node's count is at least the sum of its children's; the evictable and
  protected sizes match the unlocked and locked tokens; eviction candidates are exactly the
  unlocked leaves.
- Pinned nodes are in the tree, locked, and their pinned bytes stay within the budget.
"""

from __future__ import annotations

import torch

from kvstrata.integrations.sglang.compat import free_pages
from kvstrata.radix.errors import InvariantViolation


def _fail(message: str) -> None:
    raise InvariantViolation(message)


def _pages_of(slots: torch.Tensor, P: int, where: str) -> list[int]:
    n = slots.numel()
    if n % P:
        _fail(f"{where}: {n} slots is not a whole number of pages")
    rows = slots.to(torch.long).view(-1, P)
    expected = rows[:, :1] + torch.arange(P, device=rows.device)
    if not torch.equal(rows, expected) or bool((rows[:, 0] % P != 0).any()):
        _fail(f"{where}: slots are not whole pages")
    return rows[:, 0].div(P, rounding_mode="floor").tolist()


def check_invariants(cache, held_slots: torch.Tensor | None = None) -> None:
    P = cache.page_size
    owner: dict[int, str] = {}

    def take(pages: list[int], who: str) -> None:
        for p in pages:
            if p in owner:
                _fail(f"page {p} is held by {owner[p]} and by {who}")
            owner[p] = who

    locked = unlocked = 0
    leaves = set()
    stack = [cache.root_node]
    while stack:
        node = stack.pop()
        children = [c for c in node.children.values() if not c.evicted]
        if node is not cache.root_node:
            if len(node.value) != len(node.key):
                _fail(f"node {node.id}: {len(node.key)} tokens but {len(node.value)} slots")
            take(_pages_of(node.value, P, f"node {node.id}"), f"tree node {node.id}")
            if node.lock_ref < 0:
                _fail(f"node {node.id}: lock_ref {node.lock_ref}")
            if node.lock_ref:
                locked += len(node.key)
            else:
                unlocked += len(node.key)
            if node.lock_ref < sum(c.lock_ref for c in children):
                _fail(f"node {node.id}: lock_ref {node.lock_ref} below its children's")
            if not children and node.lock_ref == 0:
                leaves.add(node)
        for key, child in node.children.items():
            if child.parent is not node or key != child.key.child_key(P):
                _fail(f"node {child.id} hangs under the wrong parent or key")
            stack.append(child)
    if (cache.evictable_size_, cache.protected_size_) != (unlocked, locked):
        _fail(
            f"evictable/protected sizes {cache.evictable_size_}/{cache.protected_size_}, "
            f"tree has {unlocked} unlocked and {locked} locked tokens"
        )
    if leaves != set(cache.evictable_leaves):
        _fail("eviction candidates differ from the unlocked leaves")

    allocator = cache.token_to_kv_pool_allocator
    take(free_pages(allocator).tolist(), "the free list")
    if held_slots is not None and held_slots.numel():
        held = set(held_slots.to(torch.long).div(P, rounding_mode="floor").tolist())
        take(sorted(held), "running requests")
    expected = set(range(1, allocator.size // P + 1))
    if set(owner) != expected:
        missing, extra = sorted(expected - set(owner)), sorted(set(owner) - expected)
        _fail(f"pages leaked {missing[:8]} or unknown {extra[:8]}: free + used != total")

    for node in cache.pinned.values():
        if node.evicted or node.lock_ref < 1:
            _fail(f"pinned node {node.id} is evicted or unlocked")
        up = node
        while up is not cache.root_node:
            if up.parent is None or up.parent.children.get(up.key.child_key(P)) is not up:
                _fail(f"pinned node {node.id} is not in the tree")
            up = up.parent
    if cache.pinned_bytes() > cache.pin_budget_bytes:
        _fail(f"pinned bytes {cache.pinned_bytes()} exceed the budget {cache.pin_budget_bytes}")
