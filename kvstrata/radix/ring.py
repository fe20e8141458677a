"""`HotRing`: the recent window of every running sequence, in ``ring_dtype``, circular by position.

Slot ``s`` of layer ``l`` is ``capacity`` consecutive rows of ``k[l]``/``v[l]``; position ``p`` of
the sequence in slot ``s`` lives at row ``s * capacity + p % capacity``. A sequence's ring holds
positions ``[ring_start, length)``, never more than ``capacity - 1`` of them, so the positions it
keeps never collide.
"""

from __future__ import annotations

import torch

from kvstrata.radix.allocator import IdAllocator

PADDING_ROWS = 2  # the null row and the scratch row


class HotRing:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        capacity: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.capacity = capacity
        self.slots = IdAllocator(slots, "ring slots")
        # After the slots, each layer has the null row: never written, always zero; padded ring
        # tables point at it. Zeroed buffers also keep never-written rows of a slot finite. Then the
        # scratch row: written, never read (the full decode graph's padding rows store their K/V there).
        self.null_row = slots * capacity
        self.scratch_row = self.null_row + 1
        shape = (num_layers, slots * capacity + PADDING_ROWS, heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.slot_bytes = 2 * num_layers * capacity * heads * head_dim * self.k.element_size()
        self.bytes_per_token = 2 * num_layers * heads * head_dim * self.k.element_size()

    @property
    def total_bytes(self) -> int:
        """Bytes of the slots (the null row excluded)."""
        return self.slots.total * self.slot_bytes

    @property
    def padding_bytes(self) -> int:
        return PADDING_ROWS * self.bytes_per_token

    def rows(self, slot: int, start: int, stop: int) -> list[int]:
        """Flat rows of positions ``[start, stop)`` of ``slot`` (the SGLang plugin reads a request's ring)."""
        base, cap = slot * self.capacity, self.capacity
        return [base + p % cap for p in range(start, stop)]
