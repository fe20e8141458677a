"""`RingBook`: which positions of each SGLang request row live in the BF16 ring, and the step plan.

SGLang addresses a request by its ``ReqToTokenPool`` row and its K/V by token slots from its own
allocator (``req_to_token[row, pos]``; with ``page_size`` P, slot ``s`` lies in page ``s // P``).
kvstrata's stratified layout keeps history in cold pages named by those same page indices and the
recent window in a ring slot per row. This module turns one forward batch (rows, cached prefix
lengths, new-token counts) into kvstrata's own `StepBatch`, so the radix core's reference
attention and store run unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.radix.plan import NullRows, StepBatch, build_step
from kvstrata.radix.sequence import Sequence


@dataclass
class RowRing:
    """Ring bookkeeping of one request row: valid for ``generation`` (SGLang's row generation,
    bumped on every allocation of the row), holding positions ``[start, length)``; ``origin`` is
    the prefix that was cached when the ring started (the ring's first position)."""

    generation: int = -1
    origin: int = 0
    start: int = 0
    length: int = 0


def page_tables(
    rows: list[int], full_pages: list[int], req_to_token: torch.Tensor, P: int
) -> list[list[int]]:
    """The page ids (``slot // P`` of each page's first slot) of the first ``full_pages[i]`` pages of
    each request row, read from SGLang's ``req_to_token`` in one gather and one device-to-host copy
    (a copy per row would synchronize with the device once per running request, every step)."""
    most = max(full_pages, default=0)
    if most == 0:
        return [[] for _ in rows]
    index = torch.tensor(rows, dtype=torch.long, device=req_to_token.device)
    table = (req_to_token[index, 0 : most * P : P].to(torch.long) // P).tolist()
    return [ids[:full] for ids, full in zip(table, full_pages, strict=True)]


class RingBook:
    def __init__(self, rows: int, page_size: int, ring_capacity: int, window: int, nulls: NullRows) -> None:
        self.rows = [RowRing() for _ in range(rows)]
        self.page_size, self.ring_capacity, self.window, self.nulls = page_size, ring_capacity, window, nulls

    def ring_of(self, row: int, generation: int, prefix_len: int) -> RowRing:
        """The row's ring if it continues at ``prefix_len``; else a new empty ring starting there
        (a new request, or one whose prefix came from the radix tree). A new ring must start on a
        page boundary: the positions before it are read from cold pages."""
        ring = self.rows[row]
        if ring.generation == generation and ring.length == prefix_len:
            return ring
        if prefix_len % self.page_size:
            raise ValueError(
                f"request row {row}: cached prefix of {prefix_len} tokens is not page aligned "
                f"(page_size={self.page_size}) and its recent window is gone"
            )
        return RowRing(generation, prefix_len, prefix_len, prefix_len)

    def plan(
        self,
        rows: list[int],
        generations: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
    ) -> StepBatch:
        """Plan one forward step and record the rings as they will be after it."""
        P = self.page_size
        full_pages = [(L + n) // P for L, n in zip(prefix_lens, extend_lens, strict=True)]
        tables = page_tables(rows, full_pages, req_to_token, P)
        seqs, new_pages, rings = [], [], []
        for i, (row, gen, L, n) in enumerate(zip(rows, generations, prefix_lens, extend_lens, strict=True)):
            if n < 1:
                raise ValueError(f"request row {row}: {n} new tokens")
            ring = self.ring_of(row, gen, L)
            page_ids = tables[i]
            seqs.append(
                Sequence(
                    seq_id=i,
                    token_ids=[],
                    extra_key=None,
                    slot=row,
                    cached_tokens=ring.origin,
                    length=L,
                    ring_start=ring.start,
                    page_ids=page_ids,
                    tree_pages=0,
                )
            )
            new_pages.append(page_ids[L // P :])
            rings.append(ring)
        batch = build_step(
            seqs,
            extend_lens,
            new_pages,
            page_size=P,
            ring_capacity=self.ring_capacity,
            window=self.window,
            sink_of=None,
            nulls=self.nulls,
            device=device,
        )
        after = zip(rows, rings, batch.new_ring_start, prefix_lens, extend_lens, strict=True)
        for row, ring, start, L, n in after:
            ring.start, ring.length = start, L + n
            self.rows[row] = ring
        return batch
