"""`StepBatch`: the index tensors of one forward step, built once and reused by every layer.

Sequences with the same number of new tokens form a group that is attended as one padded batch
(all decodes together; a prefill chunk with its equals). For each group the plan holds the cold
page table, the sink pages, the ring rows and additive masks (0 or -inf); for the whole batch it
holds where completed pages gather their tokens (ring or new K/V) and which ring rows receive the
new tokens. With an image pool (page ids from ``image_base`` on), a group's image pages get a table of
their own (rows of the image pool), attended as one more key segment after the text pages.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kvstrata.radix.sequence import Sequence

NEG_INF = float("-inf")


@dataclass(eq=False)
class GroupPlan:
    """One group's index tensors. Padding reads the zero rows each store keeps for it (the pool's
    null page, the sink store's null slot, the ring's null row), so a padded slot is always a finite
    zero and never another sequence's data; the masks below exclude it anyway."""

    # [B*T] rows of this group's tokens in q/k/v, sequence-major; None: every token, in order
    rows: torch.Tensor | None
    batch: int
    tokens: int
    page_table: torch.Tensor  # [B, Np] cold pages read from the pool, padded with the null page
    cold_pages: list[int]  # valid entries of each row of page_table
    sink_table: torch.Tensor | None  # [B] sink pages, padded with the null slot; None: no sinks
    sink_valid: list[bool]
    ring_rows: torch.Tensor  # [B, R] ring rows, padded with the null row
    ring_len: list[int]
    page_size: int
    image_table: torch.Tensor | None = None  # [B, Ni] rows of the image pool, padded with its null page
    image_pages: list[int] = field(default_factory=list)  # valid entries of each row of image_table
    _tail_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.page_table.device

    def _valid(self, lengths: list[int], width: int) -> torch.Tensor:
        """[B, width] True in the first ``lengths[b]`` columns of row b."""
        n = torch.tensor(lengths, dtype=torch.long).to(self.device)
        return torch.arange(width, device=self.device).view(1, width) < n.view(-1, 1)

    def _history_valid(self) -> torch.Tensor:
        """[B, Np*P (+Ni*P) (+P) + R]: which cold, image, sink and ring keys of each sequence are real."""
        P = self.page_size
        parts = [self._valid([n * P for n in self.cold_pages], self.page_table.shape[1] * P)]
        if self.image_table is not None:
            parts.append(self._valid([n * P for n in self.image_pages], self.image_table.shape[1] * P))
        if self.sink_table is not None:
            parts.append(self._valid([P * v for v in self.sink_valid], P))
        parts.append(self._valid(self.ring_len, self.ring_rows.shape[1]))
        return torch.cat(parts, dim=1)

    def mask(self, group: int) -> torch.Tensor | None:
        """[B, 1, group*T, S] additive mask (0 or -inf) for one pass over ``[cold | image | sinks |
        ring | new]``, rows ordered (query head in group, token); None when every query sees every key
        (one sequence, one new token)."""
        B, T = self.batch, self.tokens
        if B == 1 and T == 1:
            return None
        mask = self._masks.get(group)
        if mask is None:
            # Additive: SDPA would convert a boolean mask again in every layer.
            mask = self._rows_bias(self._history_valid(), group)
            self._masks[group] = mask
        return mask

    def _rows_bias(self, history: torch.Tensor, group: int) -> torch.Tensor:
        """[B, 1, group*T, H+T] bias: each query sees the valid ``history`` keys [B, H] and the new
        tokens up to itself; rows ordered (query head in group, token)."""
        B, T = self.batch, self.tokens
        causal = torch.ones((T, T), dtype=torch.bool, device=self.device).tril()
        seen = torch.cat([history.view(B, 1, -1).expand(B, T, -1), causal.expand(B, T, T)], dim=2)
        return _bias(seen).unsqueeze(1).repeat(1, 1, group, 1)

    @cached_property
    def kernel_lengths(self) -> torch.Tensor:
        """[3, B] int32 on the plan's device: cold pages, ring rows and sink flag (0/1) of each
        sequence, for the Triton kernels (lengths instead of masks)."""
        rows = [self.cold_pages, self.ring_len, [int(s) for s in self.sink_valid]]
        return torch.tensor(rows, dtype=torch.int32).to(self.device)

    @cached_property
    def image_plan(self) -> GroupPlan | None:
        """The group's image pages as a plan of their own (``image_table`` as its page table, no sinks,
        the same ring rows), for the Triton kernels' pass over the image pool; None when no sequence of
        the group has an image page in the pool. Every cold page lies before the ring and the new tokens,
        so all of them are visible to every query of the step (decode and extend alike)."""
        if self.image_table is None or self.image_table.shape[1] == 0:
            return None
        return GroupPlan(
            self.rows,
            self.batch,
            self.tokens,
            self.image_table,
            self.image_pages,
            None,
            [False] * self.batch,
            self.ring_rows,
            self.ring_len,
            self.page_size,
        )

    @cached_property
    def cold_bias(self) -> torch.Tensor:
        """[B, 1, 1, Np*P] additive mask of the cold keys (block-wise pass)."""
        P = self.page_size
        valid = self._valid([n * P for n in self.cold_pages], self.page_table.shape[1] * P)
        return _bias(valid).view(self.batch, 1, 1, -1)

    @cached_property
    def image_bias(self) -> torch.Tensor:
        """[B, 1, 1, Ni*P] additive mask of the image-pool keys (block-wise pass)."""
        assert self.image_table is not None
        P = self.page_size
        valid = self._valid([n * P for n in self.image_pages], self.image_table.shape[1] * P)
        return _bias(valid).view(self.batch, 1, 1, -1)

    @cached_property
    def sink_bias(self) -> torch.Tensor:
        """[B, 1, 1, P] additive mask of the sink keys (block-wise pass)."""
        valid = self._valid([self.page_size * v for v in self.sink_valid], self.page_size)
        return _bias(valid).view(self.batch, 1, 1, -1)

    def tail_bias(self, group: int) -> torch.Tensor:
        """[B, 1, group*T, R+T] bias of ring and new keys for GQA rows ordered (query head in
        group, token) (block-wise pass)."""
        bias = self._tail_bias.get(group)
        if bias is None:
            bias = self._rows_bias(self._valid(self.ring_len, self.ring_rows.shape[1]), group)
            self._tail_bias[group] = bias
        return bias


@dataclass(eq=False)
class WritePlan:
    page_ids: torch.Tensor  # [Nw] pages completed in this step
    from_ring: tuple[torch.Tensor, torch.Tensor]  # (rows of the [Nw*P] page tensor, ring rows)
    from_new: tuple[torch.Tensor, torch.Tensor]  # (rows of the page tensor, rows of k/v)
    sink_pages: torch.Tensor  # [Ns] indices into page_ids of first pages that get a sink
    sink_slots: torch.Tensor  # [Ns]
    ring_dst: torch.Tensor  # ring rows receiving new tokens
    ring_src: torch.Tensor  # their rows in k/v
    # With image pages among page_ids: (indices of text pages, indices of image pages, image pool rows)
    image_split: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def kernel_sources(self, page_size: int) -> torch.Tensor:
        """[Nw * P] int64, where each row of the completed pages comes from, for the Triton page
        quantize: a ring row (>= 0), or new row ``r`` of k/v as ``-1 - r``."""
        src = getattr(self, "_kernel_sources", None)
        if src is None:
            src = torch.empty(
                self.page_ids.numel() * page_size, dtype=torch.long, device=self.page_ids.device
            )
            src.index_copy_(0, self.from_ring[0], self.from_ring[1])
            src.index_copy_(0, self.from_new[0], -1 - self.from_new[1])
            self._kernel_sources = src
        return src

    @cached_property
    def kernel_sink_slots(self) -> torch.Tensor:
        """[Nw] int64: the sink slot each completed page also fills, or -1."""
        slots = torch.full_like(self.page_ids, -1)
        slots.index_copy_(0, self.sink_pages, self.sink_slots)
        return slots


@dataclass(eq=False)
class StepBatch:
    seqs: list[Sequence]
    n_new: list[int]
    num_tokens: int
    groups: list[GroupPlan]
    write: WritePlan
    new_ring_start: list[int]
    new_pages: list[list[int]]
    layers_done: set[int] = field(default_factory=set)
    closed: bool = False


def _long(values: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=device)


def ring_start_after(seq: Sequence, new_length: int, window: int, page_size: int) -> int:
    """``max(ring_start, origin, floor((length - W) / P) * P)``: monotone, so a widened window
    never asks the ring for positions it already dropped."""
    return max(seq.ring_start, seq.cached_tokens, (new_length - window) // page_size * page_size)


@dataclass(frozen=True)
class NullRows:
    """Ids of the zero rows that padding reads: the pool's null page, the sink store's null slot
    and the ring's null row."""

    page: int
    sink: int
    ring_row: int
    image_page: int = 0


def build_step(
    seqs: list[Sequence],
    n_new: list[int],
    new_pages: list[list[int]],
    *,
    page_size: int,
    ring_capacity: int,
    window: int,
    sink_of: dict[int, int] | None,
    nulls: NullRows,
    device: torch.device,
    image_base: int | None = None,
) -> StepBatch:
    """Plan a step; pages for the tokens must already be in ``seq.page_ids``. Page ids from
    ``image_base`` on live in the image pool."""
    P, R = page_size, ring_capacity
    offsets, total = [], 0
    for n in n_new:
        offsets.append(total)
        total += n
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(n_new):
        by_size.setdefault(n, []).append(i)
    # One group holds every token, in order: it needs no row gather (rows None).
    every_token = len(by_size) == 1
    groups = [
        _plan_group(
            [seqs[i] for i in idx],
            [offsets[i] for i in idx],
            n,
            P,
            R,
            sink_of,
            nulls,
            every_token,
            device,
            image_base,
        )
        for n, idx in by_size.items()
    ]

    write, new_starts = _plan_writes(seqs, n_new, offsets, P, R, window, sink_of, device)
    if image_base is not None:
        write.image_split = _split_image_pages(write.page_ids, image_base)
    return StepBatch(list(seqs), list(n_new), total, groups, write, new_starts, new_pages)


def _plan_writes(
    seqs: list[Sequence],
    n_new: list[int],
    offsets: list[int],
    P: int,
    R: int,
    window: int,
    sink_of: dict[int, int] | None,
    device: torch.device,
) -> tuple[WritePlan, list[int]]:
    """Where each completed page gathers its tokens, and which ring rows take the new tokens.

    A page completed by this step holds positions ``[j * P, (j + 1) * P)``; those below the old
    length ``L`` (fewer than ``P``) come from the ring, the rest from the new K/V. Index ranges
    are built with ``arange``, so a prefill chunk costs no per-token Python work."""
    write_pages: list[int] = []
    from_ring: list[tuple[list[int], list[int]]] = []
    from_new: list[torch.Tensor] = []
    new_src: list[torch.Tensor] = []
    sink_pages: list[int] = []
    sink_slots: list[int] = []
    ring_dst: list[torch.Tensor] = []
    ring_src: list[torch.Tensor] = []
    new_starts = []
    for seq, n, off in zip(seqs, n_new, offsets, strict=True):
        L, base = seq.length, seq.slot * R
        first, last = L // P, (L + n) // P
        if last > first:
            row0 = len(write_pages) * P - first * P  # page tensor row of position first * P is 0
            if first == 0 and sink_of is not None:
                sink_pages.append(len(write_pages))
                sink_slots.append(sink_of[seq.page_ids[0]])
            write_pages.extend(seq.page_ids[first:last])
            old = range(first * P, L)
            from_ring.append(([row0 + p for p in old], [base + p % R for p in old]))
            pos = torch.arange(L, last * P)
            from_new.append(row0 + pos)
            new_src.append(off + pos - L)
        new_start = ring_start_after(seq, L + n, window, P)
        new_starts.append(new_start)
        pos = torch.arange(max(L, new_start), L + n)
        ring_dst.append(base + pos % R)
        ring_src.append(off + pos - L)

    def cat(parts: list[torch.Tensor]) -> torch.Tensor:
        return torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long, device=device)

    write = WritePlan(
        page_ids=_long(write_pages, device),
        from_ring=(
            _long([r for rows, _ in from_ring for r in rows], device),
            _long([r for _, rows in from_ring for r in rows], device),
        ),
        from_new=(cat(from_new), cat(new_src)),
        sink_pages=_long(sink_pages, device),
        sink_slots=_long(sink_slots, device),
        ring_dst=cat(ring_dst),
        ring_src=cat(ring_src),
    )
    return write, new_starts


def _split_image_pages(
    page_ids: torch.Tensor, image_base: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(indices of text pages, indices of image pages, their image pool rows) of ``page_ids``;
    None when none is an image page."""
    is_image = page_ids >= image_base
    if not bool(is_image.any()):
        return None
    image = is_image.nonzero().view(-1)
    return (~is_image).nonzero().view(-1), image, page_ids.index_select(0, image) - image_base


def _padded(rows: list[list[int]], null: int, device: torch.device) -> torch.Tensor:
    """[len(rows), longest] table of ``rows`` padded with ``null``."""
    width = max(len(r) for r in rows)
    return _long([p for r in rows for p in (*r, *[null] * (width - len(r)))], device).view(len(rows), width)


def _plan_group(
    seqs: list[Sequence],
    offsets: list[int],
    n: int,
    P: int,
    R: int,
    sink_of: dict[int, int] | None,
    nulls: NullRows,
    every_token: bool,
    device: torch.device,
    image_base: int | None,
) -> GroupPlan:
    B = len(seqs)
    rows = None if every_token else torch.cat([torch.arange(o, o + n) for o in offsets]).to(device)
    cold: list[list[int]] = []
    sinks: list[int | None] = []
    for seq in seqs:
        first = 0
        sink = None
        if sink_of is not None and seq.ring_start >= P:
            sink = sink_of[seq.page_ids[0]]
            first = 1
        sinks.append(sink)
        cold.append(seq.page_ids[first : seq.ring_start // P])
    image: list[list[int]] = []
    if image_base is not None:
        image = [[p - image_base for p in c if p >= image_base] for c in cold]
        cold = [[p for p in c if p < image_base] for c in cold]
    page_table = _padded(cold, nulls.page, device)

    sink_table = None
    if any(s is not None for s in sinks):
        sink_table = _long([nulls.sink if s is None else s for s in sinks], device)

    ring_len = [seq.length - seq.ring_start for seq in seqs]
    r_max = max(ring_len)
    ring: list[int] = []
    for seq, length in zip(seqs, ring_len, strict=True):
        base = seq.slot * R
        ring.extend(base + p % R for p in range(seq.ring_start, seq.length))
        ring.extend([nulls.ring_row] * (r_max - length))
    ring_rows = _long(ring, device).view(B, r_max)
    return GroupPlan(
        rows,
        B,
        n,
        page_table,
        [len(c) for c in cold],
        sink_table,
        [s is not None for s in sinks],
        ring_rows,
        ring_len,
        P,
        _padded(image, nulls.image_page, device) if image else None,
        [len(c) for c in image],
    )


def _bias(valid: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    return torch.where(valid, zero, NEG_INF)
