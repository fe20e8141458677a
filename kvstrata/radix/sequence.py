"""`Sequence`: one running request's view of the cache (its pages, ring slot and lengths)."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import NamedTuple

from kvstrata.radix.tree import TreeNode


@dataclass(eq=False)
class Sequence:
    """``token_ids[:length]`` have K/V in the cache; the engine appends generated tokens.

    ``page_ids[i]`` holds positions ``[i * P, (i + 1) * P)``; the first ``tree_pages`` belong to
    the radix tree (locked through ``handle``), the rest are private to this sequence. The ring
    holds ``[ring_start, length)``; ``cached_tokens`` (the matched prefix) is the ring's origin.
    ``ring_clobbered``: a cancelled step wrote ring rows that alias positions this sequence still
    reads, so it cannot take another step (its full pages are intact: `finish` may still insert them).
    """

    seq_id: int
    token_ids: list[int]
    extra_key: Hashable
    slot: int
    cached_tokens: int
    length: int
    ring_start: int
    page_ids: list[int] = field(default_factory=list)
    tree_pages: int = 0
    handle: TreeNode | None = None
    in_step: bool = False
    finished: bool = False
    ring_clobbered: bool = False

    @property
    def private_pages(self) -> list[int]:
        return self.page_ids[self.tree_pages :]


class PrefixMatch(NamedTuple):
    """Result of `StratifiedKVCache.match_prefix`: the cached pages, a handle for pin/unpin."""

    page_ids: list[int]
    handle: TreeNode | None
    tokens: int
