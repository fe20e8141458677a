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

import numpy as np
import torch

from kvstrata.radix.plan import NullRows, StepBatch, build_step
from kvstrata.radix.sequence import Sequence

Ints = list[int] | torch.Tensor  # host integers: a list, or a CPU tensor (read without a copy)
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
    """Host int64 tensors of one decode step of ``bs`` entries, for a captured graph (`graph`), each
    ``[bs]`` (``lengths``: ``[3, bs]``): what the device turns into what the kernels read (page
    tables, completed page ids, every entry's ring rows and the rows of the page it completes), so
    a step copies a few integers per entry to the device. Padding entries (row `PADDING_ROW`) read no
    history, complete no page (``complete`` 0: the page-quantize kernel skips them) and write their
    token to a row of ring slot 0, which belongs to no request."""

    rows: torch.Tensor  # request rows
    page_col: torch.Tensor  # page index of the new token's position (L // P)
    complete: torch.Tensor  # 1 when the new token completes that page
    lengths: torch.Tensor  # [3, bs] cold pages, ring rows, sink flag (0)
    ring_start: torch.Tensor  # first position held in the ring (the rows are positions [ring_start, L))
    ring_base: torch.Tensor  # first ring row of the entry's slot (row * ring capacity; 0 for padding)
    ring_dst: torch.Tensor  # ring row of each new token
    pages_completed: int


class RingBook:
    """The rings of every request row, as int64 host arrays indexed by row, so a decode step of a
    large batch is planned with a few array operations, not a Python loop over its requests (numpy:
    an operation on a few hundred integers costs it about a microsecond, torch several); `ring`
    reads one row's ring as a `RowRing`."""

    def __init__(self, rows: int, page_size: int, ring_capacity: int, window: int, nulls: NullRows) -> None:
        self.generation = np.full(rows, -1, dtype=np.int64)
        self.origin = np.zeros(rows, dtype=np.int64)
        self.start = np.zeros(rows, dtype=np.int64)
        self.length = np.zeros(rows, dtype=np.int64)
        self.page_size, self.ring_capacity, self.window, self.nulls = page_size, ring_capacity, window, nulls

    def ring(self, row: int) -> RowRing:
        return RowRing(
            int(self.generation[row]), int(self.origin[row]), int(self.start[row]), int(self.length[row])
        )

    def plan(
        self,
        rows: list[int],
        generations: list[int],
        prefix_lens: list[int],
        extend_lens: list[int],
        req_to_token: torch.Tensor,
        device: torch.device,
    ) -> StepBatch:
        """Plan one forward step and record the rings as they will be after it. A row whose ring
        does not continue at its cached prefix (a new request, or one whose prefix came from the
        radix tree) starts a new empty ring there, which must be page aligned: the positions
        before it are read from cold pages."""
        P = self.page_size
        full_pages = [(L + n) // P for L, n in zip(prefix_lens, extend_lens, strict=True)]
        tables = page_tables(rows, full_pages, req_to_token, P)
        index = np.asarray(rows, dtype=np.int64)
        state = np.stack([self.generation, self.origin, self.start, self.length])[:, index].T.tolist()
        seqs, new_pages, rings = [], [], []
        for i, (row, gen, L, n) in enumerate(zip(rows, generations, prefix_lens, extend_lens, strict=True)):
            if n < 1:
                raise ValueError(f"request row {row}: {n} new tokens")
            ring = RowRing(*state[i])
            if ring.generation != gen or ring.length != L:
                _check_aligned(row, L, P)
                ring = RowRing(gen, L, L, L)
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
        self.generation[index] = [ring.generation for ring in rings]
        self.origin[index] = [ring.origin for ring in rings]
        self.start[index] = batch.new_ring_start
        self.length[index] = np.add(prefix_lens, extend_lens)
        return batch

    def plan_decode(self, rows: Ints, generations: Ints, prefix_lens: Ints) -> DecodePlan:
        """Plan a decode step (one new token per entry; request rows, their generations and cached
        prefix lengths as int sequences or CPU tensors) as `DecodePlan` and record the rings as
        they will be after it, exactly as `plan` does for the same batch."""
        P, R, W = self.page_size, self.ring_capacity, self.window
        rows_in = _int64(rows)
        gen, L = _int64(generations), _int64(prefix_lens)
        bs = rows_in.size
        # Padding: SGLang fills a padded entry's sequence length with 1 (prefix 0; a real decode entry
        # has at least one token before it), but a version that leaves the padded tail of its
        # request-row buffer stale would name a live row here: never touch that row's ring.
        live = (rows_in != PADDING_ROW) & (L > 0)
        rows_t = np.where(live, rows_in, PADDING_ROW)
        fresh = live & ((self.generation[rows_t] != gen) | (self.length[rows_t] != L))
        misaligned = np.flatnonzero(fresh & (L % P != 0))
        if misaligned.size:
            i = int(misaligned[0])
            _check_aligned(int(rows_t[i]), int(L[i]), P)
        origin = np.where(fresh, L, self.origin[rows_t])
        start = np.where(fresh, L, self.start[rows_t]) * live
        base = rows_t * R * live
        lens = (L - start) * live
        cols = L // P * live
        done = live & ((L + 1) % P == 0)
        ring_dst = np.where(live, base + L % R, np.arange(bs) % R)
        kept = rows_t[live]
        self.generation[kept], self.origin[kept] = gen[live], origin[live]
        self.start[kept] = np.maximum(np.maximum(start, origin), (L + 1 - W) // P * P)[live]
        self.length[kept] = L[live] + 1
        complete = done.astype(np.int64)
        lengths = np.stack([start // P, lens, np.zeros_like(lens)])
        return DecodePlan(
            *(torch.from_numpy(a) for a in (rows_t, cols, complete, lengths, start, base, ring_dst)),
            pages_completed=int(complete.sum()),
        )


def _int64(values: Ints) -> np.ndarray:
    """A host int64 array of a sequence or a CPU tensor (a tensor's memory is shared, not copied)."""
    if isinstance(values, torch.Tensor):
        return values.to(torch.long).numpy()
    return np.asarray(values, dtype=np.int64)


def _check_aligned(row: int, prefix_len: int, page_size: int) -> None:
    if prefix_len % page_size:
        raise ValueError(
            f"request row {row}: cached prefix of {prefix_len} tokens is not page aligned "
            f"(page_size={page_size}) and its recent window is gone"
        )
