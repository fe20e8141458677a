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

from kvstrata.radix.plan import NullRows, StepBatch, build_step, next_ring_start
from kvstrata.radix.sequence import Sequence

PADDING_ROW = 0  # SGLang's ReqToTokenPool never gives row 0 to a request; padded batches use it


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


@dataclass
class DecodePlan:
    """Host int64 tensors of one decode step of ``bs`` entries, for a captured graph (`graph`):
    what the Triton kernels read, with the page ids left to a gather on the device (``page_col``,
    ``complete``). Padding entries (row `PADDING_ROW`) read no history, complete no page (page 0,
    SGLang's padding page, sourced from the null ring row) and write their token to a row of ring
    slot 0, which belongs to no request."""

    rows: torch.Tensor  # [bs] request rows
    page_col: torch.Tensor  # [bs] page index of the new token's position (L // P)
    complete: torch.Tensor  # [bs] 1 when the new token completes that page
    lengths: torch.Tensor  # [3, bs] cold pages, ring rows, sink flag (0)
    ring_rows: torch.Tensor  # [bs, R] ring rows of positions [ring_start, L), padded with the null row
    sources: torch.Tensor  # [bs * P] rows of the completed pages (`WritePlan.kernel_sources`)
    ring_dst: torch.Tensor  # [bs] ring row of each new token
    pages_completed: int


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

    def plan_decode(self, rows: list[int], generations: list[int], prefix_lens: list[int]) -> DecodePlan:
        """Plan a decode step (one new token per entry) as `DecodePlan` and record the rings as they
        will be after it, exactly as `plan` does for the same batch."""
        P, R, null = self.page_size, self.ring_capacity, self.nulls.ring_row
        bs = len(rows)
        starts, bases, lens, cols, complete = [0] * bs, [0] * bs, [0] * bs, [0] * bs, [0] * bs
        ring_dst = [i % R for i in range(bs)]
        rows = list(rows)
        for i, (row, gen, L) in enumerate(zip(rows, generations, prefix_lens, strict=True)):
            if row == PADDING_ROW or L == 0:
                # Padding: SGLang fills a padded entry's sequence length with 1 (prefix 0; a real decode
                # entry has at least one token before it), but a version that leaves the padded tail of
                # its request-row buffer stale would name a live row here: never touch that row's ring.
                rows[i] = PADDING_ROW
                continue
            ring = self.ring_of(row, gen, L)
            starts[i], bases[i], lens[i], cols[i] = ring.start, row * R, L - ring.start, L // P
            complete[i] = int((L + 1) % P == 0)
            ring_dst[i] = row * R + L % R
            ring.start = next_ring_start(ring.start, ring.origin, L + 1, self.window, P)
            ring.length = L + 1
            self.rows[row] = ring
        start_t, base_t = torch.tensor(starts).view(bs, 1), torch.tensor(bases).view(bs, 1)
        len_t, done_t = torch.tensor(lens).view(bs, 1), torch.tensor(complete).view(bs, 1)
        col = torch.arange(R).view(1, R)
        ring_rows = torch.where(col < len_t, base_t + (start_t + col) % R, null)
        # Page of position L = page_col * P + P - 1: its first P - 1 rows from the ring, the last the new row.
        tok = torch.arange(P).view(1, P)
        first = torch.tensor(cols).view(bs, 1) * P
        own = -1 - torch.arange(bs).view(bs, 1)
        sources = torch.where(tok < P - 1, base_t + (first + tok) % R, own)
        sources = torch.where(done_t.bool(), sources, null).reshape(-1)
        n_cold = [s // P for s in starts]
        return DecodePlan(
            rows=torch.tensor(rows, dtype=torch.long),
            page_col=torch.tensor(cols, dtype=torch.long),
            complete=done_t.view(bs),
            lengths=torch.tensor([n_cold, lens, [0] * bs], dtype=torch.long),
            ring_rows=ring_rows,
            sources=sources,
            ring_dst=torch.tensor(ring_dst, dtype=torch.long),
            pages_completed=sum(complete),
        )
