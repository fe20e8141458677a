"""`StepBatch`: the index tensors of one forward step, built once and reused by every layer.

Sequences with the same number of new tokens form a group that is attended as one padded batch
(all decodes together; a prefill chunk with its equals). For each group the plan holds the cold
page table, the sink pages, the ring rows and additive masks (0 or -inf); for the whole batch it
holds where completed pages gather their tokens (ring or new K/V) and which ring rows receive the
new tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstrata.radix.sequence import Sequence

NEG_INF = float("-inf")


@dataclass(eq=False)
class GroupPlan:
    rows: torch.Tensor  # [B*T] rows of this group's tokens in q/k/v, sequence-major
    batch: int
    tokens: int
    page_table: torch.Tensor  # [B, Np] cold pages read from the pool, padded with page 0
    cold_bias: torch.Tensor  # [B, 1, 1, Np*P]
    sink_table: torch.Tensor | None  # [B] sink pages, padded with 0
    sink_bias: torch.Tensor | None  # [B, 1, 1, P]
    ring_rows: torch.Tensor  # [B, R] ring rows, padded with the slot's first row
    tail_mask: torch.Tensor  # [B, T, R+T] True where a query sees a ring or new key
    _tail_bias: dict[int, torch.Tensor] = field(default_factory=dict)

    def tail_bias(self, group: int) -> torch.Tensor:
        """[B, 1, group*T, R+T] bias for GQA rows ordered (query head in group, token)."""
        bias = self._tail_bias.get(group)
        if bias is None:
            zero = torch.zeros((), dtype=torch.float32, device=self.tail_mask.device)
            bias = torch.where(self.tail_mask, zero, NEG_INF).unsqueeze(1).repeat(1, 1, group, 1)
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


def build_step(
    seqs: list[Sequence],
    n_new: list[int],
    new_pages: list[list[int]],
    *,
    page_size: int,
    ring_capacity: int,
    window: int,
    sink_of: dict[int, int] | None,
    device: torch.device,
) -> StepBatch:
    """Plan a step; pages for the tokens must already be in ``seq.page_ids``."""
    P, R = page_size, ring_capacity
    offsets, total = [], 0
    for n in n_new:
        offsets.append(total)
        total += n
    by_size: dict[int, list[int]] = {}
    for i, n in enumerate(n_new):
        by_size.setdefault(n, []).append(i)
    groups = [
        _plan_group([seqs[i] for i in idx], [offsets[i] for i in idx], n, P, R, sink_of, device)
        for n, idx in by_size.items()
    ]

    write, new_starts = _plan_writes(seqs, n_new, offsets, P, R, window, sink_of, device)
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


def _plan_group(
    seqs: list[Sequence],
    offsets: list[int],
    n: int,
    P: int,
    R: int,
    sink_of: dict[int, int] | None,
    device: torch.device,
) -> GroupPlan:
    B = len(seqs)
    rows = torch.cat([torch.arange(o, o + n, device=device) for o in offsets])
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
    n_pages = max(len(c) for c in cold)
    page_table = torch.zeros((B, n_pages), dtype=torch.long, device=device)
    page_valid = torch.zeros((B, n_pages), dtype=torch.bool, device=device)
    for b, c in enumerate(cold):
        page_table[b, : len(c)] = torch.tensor(c, dtype=torch.long)
        page_valid[b, : len(c)] = True
    cold_bias = _bias(page_valid.repeat_interleave(P, dim=1)).view(B, 1, 1, n_pages * P)

    sink_table = sink_bias = None
    if any(s is not None for s in sinks):
        sink_table = _long([s or 0 for s in sinks], device)
        valid = _long([s is not None for s in sinks], device).bool()
        sink_bias = _bias(valid.view(B, 1).expand(B, P)).view(B, 1, 1, P)

    ring_len = [seq.length - seq.ring_start for seq in seqs]
    r_max = max(ring_len)
    ring_rows = torch.empty((B, r_max), dtype=torch.long, device=device)
    for b, seq in enumerate(seqs):
        pos = torch.arange(seq.ring_start, seq.ring_start + r_max, device=device)
        ring_rows[b] = torch.where(pos < seq.length, seq.slot * R + pos % R, seq.slot * R)
    ring_ok = torch.arange(r_max, device=device).view(1, 1, r_max) < _long(ring_len, device).view(B, 1, 1)
    causal = torch.ones((n, n), dtype=torch.bool, device=device).tril()
    tail_mask = torch.cat([ring_ok.expand(B, n, r_max), causal.expand(B, n, n)], dim=2)
    return GroupPlan(rows, B, n, page_table, cold_bias, sink_table, sink_bias, ring_rows, tail_mask)


def _bias(valid: torch.Tensor) -> torch.Tensor:
    zero = torch.zeros((), dtype=torch.float32, device=valid.device)
    return torch.where(valid, zero, NEG_INF)
