"""`StepBatch`: the index tensors of one forward step, built once and reused by every layer.

Adjacent sequences with the same number of new tokens form a group that is attended as one padded batch
(all decodes together; a prefill chunk with its equals) and reads its rows of q/k/v as one slice. For
each group the plan holds the cold page table, the sink pages, the ring rows and additive masks (0 or
-inf); for the whole batch it holds where completed pages gather their tokens (ring or new K/V) and
which ring rows receive the new tokens. With an image pool (page ids from ``image_base`` on), a group's
image pages get a table of their own (rows of the image pool), attended as one more key segment after
the text pages. Likewise raised pages (ids in ``[raised_base, raised_end)``, the raised pool's rows):
one more table and segment, after the image pages.
"""

from __future__ import annotations

from array import array
from dataclasses import dataclass, field, fields
from functools import cached_property
from typing import TYPE_CHECKING

import torch

from kvstrata.radix.page_table import SlotPageTable, TableUpdate
from kvstrata.radix.sequence import Sequence

if TYPE_CHECKING:
    from kvstrata.radix.pool import ColdPool

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
    raised_table: torch.Tensor | None = None  # [B, Nr] rows of the raised pool, padded with its null page
    raised_pages: list[int] = field(default_factory=list)  # valid entries of each row of raised_table
    # [3, B] int64: cold pages, ring rows and sink flag (0/1) of each sequence (built with the plan)
    lengths: torch.Tensor | None = None
    # With a `SlotPageTable`: [B] slot, first table entry, ring start and ring base of each sequence,
    # from which `build_step` makes page_table and ring_rows on the device after the upload.
    device_index: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None = None
    # (start, end): the group's rows of q/k/v as one run (``rows`` is that range), read as a slice and
    # written in place, not gathered (groups are runs of adjacent sequences, so `build_step` always sets
    # it beside ``rows``; the grouping by size gathered: 3% of the serving workload's prefill, H200)
    span: tuple[int, int] | None = None
    _tail_bias: dict[int, torch.Tensor] = field(default_factory=dict)
    _masks: dict[int, torch.Tensor] = field(default_factory=dict)

    def take(self, x: torch.Tensor) -> torch.Tensor:
        """This group's rows of the step's ``[tokens, ...]`` tensor ``x``, sequence-major: ``x`` itself,
        a slice of it (a view) or a gathered copy."""
        if self.rows is None:
            return x
        if self.span is not None:
            return x[self.span[0] : self.span[1]]
        return x.index_select(0, self.rows)

    def put(self, out: torch.Tensor, got: torch.Tensor) -> None:
        """Write this group's result ``got`` (as `take` returns rows) into its rows of ``out``."""
        if self.rows is None or self.span is not None:
            into = self.take(out)
            if into.data_ptr() != got.data_ptr():
                into.copy_(got)
        else:
            out.index_copy_(0, self.rows, got.to(out.dtype))

    @property
    def device(self) -> torch.device:
        return self.page_table.device

    def _valid(self, lengths: list[int], width: int) -> torch.Tensor:
        """[B, width] True in the first ``lengths[b]`` columns of row b."""
        n = torch.tensor(lengths, dtype=torch.long).to(self.device)
        return torch.arange(width, device=self.device).view(1, width) < n.view(-1, 1)

    def _history_valid(self) -> torch.Tensor:
        """[B, Np*P (+Ni*P) (+Nr*P) (+P) + R]: which cold, image, raised, sink and ring keys of each
        sequence are real."""
        P = self.page_size
        parts = [self._valid([n * P for n in self.cold_pages], self.page_table.shape[1] * P)]
        if self.image_table is not None:
            parts.append(self._valid([n * P for n in self.image_pages], self.image_table.shape[1] * P))
        if self.raised_table is not None:
            parts.append(self._valid([n * P for n in self.raised_pages], self.raised_table.shape[1] * P))
        if self.sink_table is not None:
            parts.append(self._valid([P * v for v in self.sink_valid], P))
        parts.append(self._valid(self.ring_len, self.ring_rows.shape[1]))
        return torch.cat(parts, dim=1)

    def mask(self, group: int) -> torch.Tensor | None:
        """[B, 1, group*T, S] additive mask (0 or -inf) for one pass over ``[cold | image | raised |
        sinks | ring | new]``, rows ordered (query head in group, token); None when every query sees every key
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
        sequence, for the Triton kernels (lengths instead of masks): a cast on the device of the
        ``lengths`` uploaded with the plan, so no host copy waits on the device."""
        if self.lengths is None:
            rows = [self.cold_pages, self.ring_len, [int(s) for s in self.sink_valid]]
            return torch.tensor(rows, dtype=torch.int32).to(self.device)
        return self.lengths.to(torch.int32)

    @cached_property
    def image_plan(self) -> GroupPlan | None:
        """The group's image pages as a plan of their own (``image_table`` as its page table, no sinks,
        the same ring rows), for the Triton kernels' pass over the image pool; None when no sequence of
        the group has an image page in the pool. Every cold page lies before the ring and the new tokens,
        so all of them are visible to every query of the step (decode and extend alike)."""
        return self._pool_plan(self.image_table, self.image_pages)

    @cached_property
    def raised_plan(self) -> GroupPlan | None:
        """The group's raised pages as a plan of their own (as `image_plan`), for the kernels' pass
        over the raised pool; None when no sequence of the group has a raised page."""
        return self._pool_plan(self.raised_table, self.raised_pages)

    def _pool_plan(self, table: torch.Tensor | None, pages: list[int]) -> GroupPlan | None:
        if table is None or table.shape[1] == 0:
            return None
        return GroupPlan(
            self.rows,
            self.batch,
            self.tokens,
            table,
            pages,
            None,
            [False] * self.batch,
            self.ring_rows,
            self.ring_len,
            self.page_size,
            span=self.span,
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
        return self._table_bias(self.image_table, self.image_pages)

    @cached_property
    def raised_bias(self) -> torch.Tensor:
        """[B, 1, 1, Nr*P] additive mask of the raised-pool keys (block-wise pass)."""
        return self._table_bias(self.raised_table, self.raised_pages)

    def _table_bias(self, table: torch.Tensor | None, pages: list[int]) -> torch.Tensor:
        assert table is not None
        P = self.page_size
        return _bias(self._valid([n * P for n in pages], table.shape[1] * P)).view(self.batch, 1, 1, -1)

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
    # With raised pages among page_ids: (indices of text-pool pages, indices of raised pages, raised rows)
    raised_split: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    def pool_writes(
        self, pool: ColdPool, image_pool: ColdPool | None, raised_pool: ColdPool | None = None
    ) -> list[tuple[torch.Tensor | None, torch.Tensor, ColdPool]]:
        """Where the completed pages go, one entry per pool: (their indices among ``page_ids``, None
        for all; their ids in that pool; the pool). Text pages go to ``pool``, image pages
        (``image_split``) to ``image_pool`` at their image pool rows, raised pages (``raised_split``)
        to ``raised_pool`` at theirs."""
        splits = [
            (split, target, name)
            for split, target, name in (
                (self.image_split, image_pool, "image"),
                (self.raised_split, raised_pool, "raised"),
            )
            if split is not None
        ]
        if not splits:
            return [(None, self.page_ids, pool)]
        text = splits[0][0][0]  # every split holds the same text-pool indices
        writes: list[tuple[torch.Tensor | None, torch.Tensor, ColdPool]] = [
            (text, self.page_ids.index_select(0, text), pool)
        ]
        for (_, which, rows), target, name in splits:
            if target is None:
                raise ValueError(f"the step completes {name} pages but no {name} pool was given")
            writes.append((which, rows, target))
        return writes

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

    @cached_property
    def one_token_each(self) -> bool:
        """Every sequence of the step has one new token (a decode step)."""
        return all(n == 1 for n in self.n_new)


NO_PAGE = -1  # the page id of a static decode entry that completes no page: the page quantize skips it


def static_decode_step(
    *,
    page_table: torch.Tensor,
    sink_table: torch.Tensor | None,
    ring_rows: torch.Tensor,
    lengths: torch.Tensor,
    page_size: int,
    page_ids: torch.Tensor,
    sink_pages: torch.Tensor,
    sink_slots: torch.Tensor,
    ring_dst: torch.Tensor,
    ring_src: torch.Tensor,
    sources: torch.Tensor,
) -> StepBatch:
    """A decode `StepBatch` of ``ring_rows.shape[0]`` entries over static device buffers (CUDA graphs:
    the engine's whole-step graph, the SGLang plugin's graphs), as the Triton kernels read it: int32
    ``lengths`` instead of host lists and masks (the host lists stay placeholders of the batch's size),
    one completed page id per entry, ``sources`` what `WritePlan.kernel_sources` returns and
    ``sink_slots`` what ``kernel_sink_slots`` returns."""
    bs = ring_rows.shape[0]
    empty = torch.empty(0, dtype=torch.long, device=page_ids.device)
    group = GroupPlan(
        rows=None,
        batch=bs,
        tokens=1,
        page_table=page_table,
        cold_pages=[0] * bs,
        sink_table=sink_table,
        sink_valid=[False] * bs,
        ring_rows=ring_rows,
        ring_len=[0] * bs,
        page_size=page_size,
        lengths=lengths,
    )
    write = WritePlan(
        page_ids=page_ids,
        from_ring=(empty, empty),
        from_new=(empty, empty),
        sink_pages=sink_pages,
        sink_slots=empty,
        ring_dst=ring_dst,
        ring_src=ring_src,
    )
    write._kernel_sources = sources
    write.__dict__["kernel_sink_slots"] = sink_slots
    return StepBatch(
        seqs=[], n_new=[1] * bs, num_tokens=bs, groups=[group], write=write, new_ring_start=[], new_pages=[]
    )


def ring_start_after(seq: Sequence, new_length: int, window: int, page_size: int) -> int:
    """``max(ring_start, origin, floor((length - W) / P) * P)``: monotone, so a widened window
    never asks the ring for positions it already dropped."""
    return next_ring_start(seq.ring_start, seq.cached_tokens, new_length, window, page_size)


def next_ring_start(ring_start: int, origin: int, new_length: int, window: int, page_size: int) -> int:
    """`ring_start_after` of a ring given by its start and origin (the SGLang plugin's rings)."""
    return max(ring_start, origin, (new_length - window) // page_size * page_size)


@dataclass(frozen=True)
class NullRows:
    """Ids of the zero rows that padding reads: the pool's null page, the sink store's null slot
    and the ring's null row."""

    page: int
    sink: int
    ring_row: int
    image_page: int = 0
    raised_page: int = 0


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
    tables: SlotPageTable | None = None,
    raised_base: int | None = None,
    raised_end: int | None = None,
) -> StepBatch:
    """Plan a step; pages for the tokens must already be in ``seq.page_ids``. Page ids from
    ``image_base`` on live in the image pool, those in ``[raised_base, raised_end)`` in the raised pool.

    The index tensors are built on the host, then reach ``device`` together in one copy (`upload`):
    on CUDA one asynchronous copy from pinned memory per step, which waits for nothing. With
    ``tables`` the cold page tables and ring rows are not built on the host: the copy carries the
    table's changed entries and a few ids per sequence, and both are made on the device
    (`_finish_on_device`). A step with a page of the image or the raised pool among its sequences'
    (their ids are above every text page's) is built from the lists: the host splits its pages by pool.
    """
    P, R = page_size, ring_capacity
    if tables is not None and _holds_other_pools(seqs, image_base, raised_base):
        tables = None
    update = tables.sync(seqs) if tables is not None else None
    offsets, total = [], 0
    for n in n_new:
        offsets.append(total)
        total += n
    # A group is a run of adjacent sequences with the same number of new tokens, so its rows of q/k/v
    # are one slice (`GroupPlan.span`), never a gather; one group holding every token has rows None.
    runs: list[tuple[int, list[int]]] = []
    for i, n in enumerate(n_new):
        if runs and runs[-1][0] == n:
            runs[-1][1].append(i)
        else:
            runs.append((n, [i]))
    every_token = len(runs) == 1
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
            image_base,
            tables is not None,
            _raised_range(raised_base, raised_end),
        )
        for n, idx in runs
    ]

    write, new_starts = _plan_writes(seqs, n_new, offsets, P, R, window, sink_of)
    if image_base is not None or raised_base is not None:
        write.image_split, write.raised_split = _split_pages(
            write.page_ids, image_base, _raised_range(raised_base, raised_end)
        )
    step = StepBatch(list(seqs), list(n_new), total, groups, write, new_starts, new_pages)
    _upload_tensors([*groups, write, *([update] if update is not None else [])], device)
    if tables is not None and update is not None:
        _finish_on_device(groups, tables, update, R, nulls.ring_row)
    return step


def _finish_on_device(
    groups: list[GroupPlan], tables: SlotPageTable, update: TableUpdate, R: int, null_row: int
) -> None:
    """Write the table's changed entries, then each group's page table and ring rows (on the
    table's device, from the uploaded ``device_index`` and ``lengths``)."""
    tables.apply(update)
    for g in groups:
        assert g.device_index is not None and g.lengths is not None
        slots, first, starts, bases = g.device_index
        g.page_table = tables.gather(slots, first, g.lengths[0], max(g.cold_pages))
        width = max(g.ring_len)
        col = torch.arange(width, device=slots.device).view(1, width)
        B = g.batch
        rows = bases.view(B, 1) + (starts.view(B, 1) + col) % R
        g.ring_rows = torch.where(col < g.lengths[1].view(B, 1), rows, null_row)


def upload(tensors: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """Host int64 tensors as tensors on ``device`` (same shapes) through a single copy: one pinned
    staging buffer copied asynchronously on CUDA (no host sync; the caching host allocator keeps the
    buffer until the copy is done), views of it everywhere."""
    device = torch.device(device)
    if device.type == "cpu" or not tensors:
        return tensors
    sizes = [t.numel() for t in tensors]
    staging = torch.empty(sum(sizes), dtype=torch.long, pin_memory=device.type == "cuda")
    torch.cat([t.reshape(-1) for t in tensors], out=staging)
    flat = staging.to(device, non_blocking=True)
    return [part.view(t.shape) for part, t in zip(flat.split(sizes), tensors, strict=True)]


def _upload_tensors(plans: list[GroupPlan | WritePlan | TableUpdate], device: torch.device) -> None:
    """Move every tensor field of ``plans`` (alone or in a tuple) to ``device`` with one `upload`."""
    found: list[torch.Tensor] = []
    for plan in plans:
        for f in fields(plan):
            value = getattr(plan, f.name)
            found.extend([value] if isinstance(value, torch.Tensor) else _tensor_tuple(value))
    moved = iter(upload(found, device))
    for plan in plans:
        for f in fields(plan):
            value = getattr(plan, f.name)
            if isinstance(value, torch.Tensor):
                setattr(plan, f.name, next(moved))
            elif _tensor_tuple(value):
                setattr(plan, f.name, tuple(next(moved) for _ in value))


def _tensor_tuple(value: object) -> tuple[torch.Tensor, ...]:
    if isinstance(value, tuple) and all(isinstance(t, torch.Tensor) for t in value):
        return value
    return ()


def _ring_rows(base: int, start: int, stop: int, R: int, out: list[int]) -> None:
    """Append the ring rows ``base + p % R`` of positions ``[start, stop)``, one ``range`` per wrap
    of the ring (no per-token Python work)."""
    p = start
    while p < stop:
        end = min(stop, (p // R + 1) * R)
        row = base + p % R
        out.extend(range(row, row + end - p))
        p = end


def _plan_writes(
    seqs: list[Sequence],
    n_new: list[int],
    offsets: list[int],
    P: int,
    R: int,
    window: int,
    sink_of: dict[int, int] | None,
) -> tuple[WritePlan, list[int]]:
    """Where each completed page gathers its tokens, and which ring rows take the new tokens (host
    tensors).

    A page completed by this step holds positions ``[j * P, (j + 1) * P)``; those below the old
    length ``L`` (fewer than ``P``) come from the ring, the rest from the new K/V. Index runs are
    appended as ``range`` objects, so a prefill chunk costs no per-token Python work and a decode
    batch a few list operations per sequence."""
    write_pages: list[int] = []
    ring_rows: tuple[list[int], list[int]] = ([], [])  # (rows of the [Nw*P] page tensor, ring rows)
    new_rows: tuple[list[int], list[int]] = ([], [])  # (rows of the page tensor, rows of k/v)
    sink_pages: list[int] = []
    sink_slots: list[int] = []
    ring_dst: list[int] = []
    ring_src: list[int] = []
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
            ring_rows[0].extend(range(row0 + first * P, row0 + L))
            _ring_rows(base, first * P, L, R, ring_rows[1])
            new_rows[0].extend(range(row0 + L, row0 + last * P))
            new_rows[1].extend(range(off, off + last * P - L))
        new_start = ring_start_after(seq, L + n, window, P)
        new_starts.append(new_start)
        kept = max(L, new_start)
        _ring_rows(base, kept, L + n, R, ring_dst)
        ring_src.extend(range(off + kept - L, off + n))

    def host(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.long)

    write = WritePlan(
        page_ids=host(write_pages),
        from_ring=(host(ring_rows[0]), host(ring_rows[1])),
        from_new=(host(new_rows[0]), host(new_rows[1])),
        sink_pages=host(sink_pages),
        sink_slots=host(sink_slots),
        ring_dst=host(ring_dst),
        ring_src=host(ring_src),
    )
    return write, new_starts


def _holds_other_pools(seqs: list[Sequence], image_base: int | None, raised_base: int | None) -> bool:
    """Whether a sequence of ``seqs`` holds a page of the image or the raised pool: their ids start at
    ``raised_base`` (``image_base`` without a raised pool), above the text pool's, so one ``max`` a
    sequence (C speed over its list) tells."""
    base = raised_base if raised_base is not None else image_base
    if base is None:
        return False
    return any(seq.page_ids and max(seq.page_ids) >= base for seq in seqs)


def _raised_range(raised_base: int | None, raised_end: int | None) -> range | None:
    if raised_base is None:
        return None
    assert raised_end is not None
    return range(raised_base, raised_end)


Split = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def _split_pages(
    page_ids: torch.Tensor, image_base: int | None, raised: range | None
) -> tuple[Split | None, Split | None]:
    """(image split, raised split) of ``page_ids`` (on the host), each (indices of text-pool pages,
    indices of that pool's pages, their rows in that pool), None when no page is in that pool."""
    is_image = torch.zeros_like(page_ids, dtype=torch.bool)
    if image_base is not None:
        is_image = page_ids >= image_base
    is_raised = torch.zeros_like(is_image)
    if raised is not None:
        is_raised = (page_ids >= raised.start) & (page_ids < raised.stop)
    if not bool((is_image | is_raised).any()):
        return None, None
    text = (~(is_image | is_raised)).nonzero().view(-1)
    splits: list[Split | None] = []
    for flags, base in ((is_image, image_base), (is_raised, raised.start if raised is not None else 0)):
        which = flags.nonzero().view(-1)
        splits.append((text, which, page_ids.index_select(0, which) - base) if which.numel() else None)
    return splits[0], splits[1]


def _padded(rows: list[list[int]], null: int) -> torch.Tensor:
    """[len(rows), longest] host table of ``rows`` padded with ``null``."""
    width = max(len(r) for r in rows)
    if width == 0:
        return torch.empty((len(rows), 0), dtype=torch.long)
    flat = array("q")  # a typed buffer: no per-element conversion into the tensor
    for r in rows:
        flat.extend(r)
        flat.extend([null] * (width - len(r)))
    return torch.frombuffer(flat, dtype=torch.long).view(len(rows), width)


def _plan_group(
    seqs: list[Sequence],
    offsets: list[int],
    n: int,
    P: int,
    R: int,
    sink_of: dict[int, int] | None,
    nulls: NullRows,
    every_token: bool,
    image_base: int | None,
    on_device: bool = False,
    raised: range | None = None,
) -> GroupPlan:
    """One group's plan (host tensors). ``on_device``: page table and ring rows are left empty and
    ``device_index`` holds what `_finish_on_device` makes them from."""
    B = len(seqs)
    rows = span = None
    if not every_token:
        span = (offsets[0], offsets[0] + B * n)  # adjacent sequences: their rows are one run
        rows = torch.arange(*span, dtype=torch.long)
    firsts: list[int] = []
    sinks: list[int | None] = []
    for seq in seqs:
        first = 0
        sink = None
        if sink_of is not None and seq.ring_start >= P:
            sink = sink_of[seq.page_ids[0]]
            first = 1
        sinks.append(sink)
        firsts.append(first)
    cold_pages = [seq.ring_start // P - first for seq, first in zip(seqs, firsts, strict=True)]
    ring_len = [seq.length - seq.ring_start for seq in seqs]
    starts = torch.tensor([seq.ring_start for seq in seqs], dtype=torch.long)
    bases = torch.tensor([seq.slot * R for seq in seqs], dtype=torch.long)
    image: list[list[int]] = []
    lifted: list[list[int]] = []
    device_index = None
    if on_device:
        slots = torch.tensor([seq.slot for seq in seqs], dtype=torch.long)
        device_index = (slots, torch.tensor(firsts, dtype=torch.long), starts, bases)
        page_table = ring_rows = torch.empty((B, 0), dtype=torch.long)
    else:
        cold = [seq.page_ids[f : f + c] for seq, f, c in zip(seqs, firsts, cold_pages, strict=True)]
        if image_base is not None:
            image = [[p - image_base for p in c if p >= image_base] for c in cold]
            cold = [[p for p in c if p < image_base] for c in cold]
        if raised is not None:
            lifted = [[p - raised.start for p in c if p in raised] for c in cold]
            cold = [[p for p in c if p not in raised] for c in cold]
        cold_pages = [len(c) for c in cold]
        page_table = _padded(cold, nulls.page)
        # Ring rows of positions [ring_start, length), padded with the null row.
        col = torch.arange(max(ring_len)).view(1, -1)
        real = col < torch.tensor(ring_len, dtype=torch.long).view(B, 1)
        ring_rows = torch.where(real, bases.view(B, 1) + (starts.view(B, 1) + col) % R, nulls.ring_row)

    sink_table = None
    if any(s is not None for s in sinks):
        sink_table = torch.tensor([nulls.sink if s is None else s for s in sinks], dtype=torch.long)
    sink_valid = [s is not None for s in sinks]
    return GroupPlan(
        rows,
        B,
        n,
        page_table,
        cold_pages,
        sink_table,
        sink_valid,
        ring_rows,
        ring_len,
        P,
        _padded(image, nulls.image_page) if any(image) else None,
        [len(c) for c in image],
        _padded(lifted, nulls.raised_page) if any(lifted) else None,
        [len(c) for c in lifted],
        lengths=torch.tensor([cold_pages, ring_len, [int(v) for v in sink_valid]], dtype=torch.long),
        device_index=device_index,
        span=span,
    )


def _bias(valid: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    return torch.where(valid, zero, NEG_INF)
