"""`SinkStore`: first pages of sequences kept in ``ring_dtype`` next to their cold copy.

A sink page is bound to the cold page id of a sequence's first page and lives exactly as long as
that cold page, so a sequence that matches the prefix in the tree reads the same BF16 sink.
"""

from __future__ import annotations

import torch

from kvstrata.radix.allocator import IdAllocator


class SinkStore:
    def __init__(
        self,
        num_layers: int,
        pages: int,
        page_size: int,
        heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: str | torch.device,
    ) -> None:
        self.allocator = IdAllocator(pages, "sink pages")
        # Slot ``pages`` is the null slot: never bound, always zero; padded sink tables point at it.
        self.null_slot = pages
        shape = (num_layers, pages + 1, page_size, heads, head_dim)
        self.k = torch.zeros(shape, dtype=dtype, device=device)
        self.v = torch.zeros(shape, dtype=dtype, device=device)
        self.of_page: dict[int, int] = {}
        self.page_bytes = 2 * num_layers * page_size * heads * head_dim * self.k.element_size()

    @property
    def total_bytes(self) -> int:
        """Bytes of the allocatable sink pages (the null slot excluded)."""
        return self.allocator.total * self.page_bytes

    @property
    def padding_bytes(self) -> int:
        return self.page_bytes

    def bind(self, page_ids: list[int]) -> None:
        """Give each cold page in ``page_ids`` a sink page (caller checked ``num_free``)."""
        for page, sink in zip(page_ids, self.allocator.alloc(len(page_ids)), strict=True):
            self.of_page[page] = sink

    def release(self, page_ids: list[int]) -> None:
        """Free the sink pages bound to any of ``page_ids``."""
        sinks = [self.of_page.pop(p) for p in page_ids if p in self.of_page]
        self.allocator.free(sinks)
