"""`PinTable`: named pins of cached prefixes, with a budget (the cache's), time-to-live and counters.

A pin holds the tree node that ends a page-aligned prefix (an image span, or a text prefix pinned by
``POST /v1/cache/pins``): that node and its ancestors are never evicted while pinned. The pin id is
derived from the prefix (namespace and tokens), so pinning the same prefix again returns the same pin
and refreshes its expiry instead of pinning twice. Expired pins are released by `expire`, which the
engine calls before each step and before listing.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstrata.radix.errors import PinBudgetExceeded
from kvstrata.radix.tree import TreeNode

if TYPE_CHECKING:
    from kvstrata.radix.cache import StratifiedKVCache


@dataclass
class Pin:
    pin_id: str
    kind: str  # "image" | "prefix"
    label: str  # image hash (hex) or a caller's note
    tokens: int  # pinned prefix length in tokens (page aligned)
    node: TreeNode
    created: float
    expires_at: float | None

    def to_json(self, nbytes: int, page_size: int, now: float) -> dict[str, Any]:
        """The pin as ``/v1/cache`` lists it; ``nbytes``: its pages' exact bytes (`PinTable.describe`)."""
        return {
            "id": self.pin_id,
            "kind": self.kind,
            "label": self.label,
            "tokens": self.tokens,
            "pages": self.tokens // page_size,
            "bytes": nbytes,
            "ttl_s": None if self.expires_at is None else max(0.0, round(self.expires_at - now, 3)),
        }


class PinTable:
    def __init__(self, cache: StratifiedKVCache, clock: Callable[[], float] = time.monotonic) -> None:
        self.cache = cache
        self.clock = clock
        self.pins: dict[str, Pin] = {}
        self.created = self.expired = self.refused = 0

    @staticmethod
    def pin_id(tokens: Sequence[int], extra_key: Hashable = None) -> str:
        h = hashlib.blake2b(repr((extra_key, list(tokens))).encode(), digest_size=8)
        return "pin-" + h.hexdigest()

    def pin(
        self,
        tokens: Sequence[int],
        *,
        kind: str = "prefix",
        label: str = "",
        ttl_s: float | None = None,
        extra_key: Hashable = None,
    ) -> Pin:
        """Pin the cached full pages of ``tokens`` (all of them must be cached).

        Raises ``ValueError`` when fewer are cached and `PinBudgetExceeded` (counted as refused) when
        the budget cannot take them; nothing changes in either case.
        """
        if ttl_s is not None and ttl_s <= 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.expire()
        P = self.cache.page_size
        n = len(tokens) // P * P
        if n == 0:
            raise ValueError(f"a pin needs at least one full page ({P} tokens), got {len(tokens)} tokens")
        key = list(tokens[:n])
        now = self.clock()
        expires = None if ttl_s is None else now + ttl_s
        pin_id = self.pin_id(key, extra_key)
        old = self.pins.get(pin_id)
        if old is not None and not old.node.evicted:
            old.expires_at = (
                expires if expires is None or old.expires_at is None else max(old.expires_at, expires)
            )
            return old
        match = self.cache.match_prefix(key, extra_key)
        if match.tokens < n or match.handle is None:
            raise ValueError(f"only {match.tokens} of the prefix's {n} tokens are cached; nothing pinned")
        try:
            self.cache.pin(match.handle)
        except PinBudgetExceeded:
            self.refused += 1
            raise
        pin = Pin(pin_id, kind, label, n, match.handle, now, expires)
        self.pins[pin_id] = pin
        self.created += 1
        return pin

    def unpin(self, pin_id: str) -> Pin:
        pin = self.pins.pop(pin_id, None)
        if pin is None:
            raise KeyError(pin_id)
        self.cache.unpin(pin.node)
        return pin

    def expire(self) -> int:
        now = self.clock()
        gone = [p for p in self.pins.values() if p.expires_at is not None and p.expires_at <= now]
        for pin in gone:
            self.unpin(pin.pin_id)
        self.expired += len(gone)
        return len(gone)

    def clear(self) -> None:
        """Forget every pin (the tree was reset, which dropped their nodes)."""
        self.pins.clear()

    @property
    def pinned_bytes(self) -> int:
        return self.cache.pinned_bytes

    def describe(self, pin: Pin) -> dict[str, Any]:
        """``pin.to_json`` with its bytes counted from its pages, each in its own pool's codec."""
        nbytes = self.cache.page_ids_bytes([p for n in pin.node.path() for p in n.pages])
        return pin.to_json(nbytes, self.cache.page_size, self.clock())

    def to_json(self) -> list[dict[str, Any]]:
        return [self.describe(p) for p in sorted(self.pins.values(), key=lambda p: p.created)]
