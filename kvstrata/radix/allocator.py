"""`IdAllocator`: O(1) allocate/free of integer ids (cold pages, ring slots, sink pages)."""

from __future__ import annotations


class IdAllocator:
    """A LIFO free list of ids ``0..total-1`` with a per-id free flag to catch double frees.

    ``alloc`` takes from the end of the free list, ``free`` appends: both O(1) per id. The caller
    checks ``num_free`` first; ``alloc`` past it raises ``ValueError`` with nothing taken.
    """

    def __init__(self, total: int, name: str) -> None:
        self.total = total
        self.name = name
        self._free: list[int] = list(range(total - 1, -1, -1))
        self._is_free = bytearray(b"\x01") * total

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.total - len(self._free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise ValueError(f"{self.name}: asked for {n}, {len(self._free)} free")
        if n == 0:
            return []
        ids = self._free[-n:][::-1]
        del self._free[-n:]
        for i in ids:
            self._is_free[i] = 0
        return ids

    def free(self, ids: list[int]) -> None:
        for i in ids:
            if not 0 <= i < self.total:
                raise ValueError(f"{self.name}: id {i} out of range 0..{self.total - 1}")
            if self._is_free[i]:
                raise ValueError(f"{self.name}: id {i} freed twice")
        for i in ids:
            self._is_free[i] = 1
        self._free.extend(ids)

    def is_free(self, i: int) -> bool:
        return bool(self._is_free[i])

    def free_ids(self) -> list[int]:
        return list(self._free)

    def check(self) -> list[str]:
        """Inconsistencies between the free list and the flags, as messages (empty when sound)."""
        errors = []
        if len(set(self._free)) != len(self._free):
            errors.append(f"{self.name}: free list holds duplicates")
        flagged = sum(self._is_free)
        if flagged != len(self._free):
            errors.append(f"{self.name}: {flagged} ids flagged free but free list has {len(self._free)}")
        bad = [i for i in self._free if not 0 <= i < self.total or not self._is_free[i]]
        if bad:
            errors.append(f"{self.name}: free list ids {bad[:5]} out of range or flagged used")
        if self.num_free + self.num_used != self.total:
            errors.append(f"{self.name}: free {self.num_free} + used {self.num_used} != total {self.total}")
        return errors
