"""`SlotPageTable`: every ring slot's page ids kept on the device, updated as pages come and go.

A decode step at batch 256 and 2K context reads a 256 x 128 cold page table. Building it from the
sequences' Python lists in every step (and sending 32K ids to the device) cost most of the host time
of a step. Here the table lives on the device, one row per ring slot: a step sends only the entries
that changed since the slot's row was last synced (a decode step completes about one page in 16 per
sequence), then gathers each group's ``[B, Np]`` table on the device (`gather`), padded with the null
page exactly as the host build pads it.

The host keeps, per slot, which sequence the row holds and how many leading entries are in sync. Pages
are only appended to a running sequence (`StratifiedKVCache.begin_step`), cut from its end
(`cancel_step`), or replaced in place when its prefix moves into the tree (`cache_prefix`); the last
two call `invalidate`, since a cut entry can come back as another page in the next step. A new
sequence in a slot starts from an empty row.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstrata.radix.sequence import Sequence

INITIAL_WIDTH = 64  # pages per row at start; doubled when a sequence outgrows it


@dataclass(eq=False)
class TableUpdate:
    """Entries to write into the device table before a step's gathers: ``table[rows, cols] = pages``."""

    rows: torch.Tensor
    cols: torch.Tensor
    pages: torch.Tensor


class SlotPageTable:
    def __init__(self, slots: int, null_page: int, device: torch.device, width: int = INITIAL_WIDTH) -> None:
        self.null_page = null_page
        self.device = torch.device(device)
        self.table = torch.full((slots, max(1, width)), null_page, dtype=torch.long, device=self.device)
        self._seq_of: list[int | None] = [None] * slots  # seq_id whose pages the row holds
        self._synced: list[int] = [0] * slots  # leading entries of the row equal to its page_ids

    @property
    def width(self) -> int:
        return self.table.shape[1]

    def invalidate(self, seq: Sequence, start: int) -> None:
        """Entries from ``start`` on of ``seq``'s row may differ from its ``page_ids`` now."""
        if self._seq_of[seq.slot] == seq.seq_id:
            self._synced[seq.slot] = min(self._synced[seq.slot], start)

    def forget(self, seqs: list[Sequence]) -> None:
        """Treat the rows of ``seqs`` as unknown (a step planned with them failed before its
        entries reached the device): the next `sync` sends their pages again."""
        for seq in seqs:
            self._seq_of[seq.slot] = None

    def sync(self, seqs: list[Sequence]) -> TableUpdate:
        """The host side of bringing the rows of ``seqs`` up to date: the entries to write (host
        tensors; apply them with `apply` once on the device). Grows the table when a row needs it."""
        rows: list[int] = []
        cols: list[int] = []
        pages: list[int] = []
        longest = 0
        for seq in seqs:
            slot, n = seq.slot, len(seq.page_ids)
            if self._seq_of[slot] != seq.seq_id:
                self._seq_of[slot] = seq.seq_id
                self._synced[slot] = 0
            done = self._synced[slot]
            if n > done:
                rows.extend([slot] * (n - done))
                cols.extend(range(done, n))
                pages.extend(seq.page_ids[done:n])
            self._synced[slot] = n
            longest = max(longest, n)
        if longest > self.width:
            self._grow(longest)
        return TableUpdate(
            torch.tensor(rows, dtype=torch.long),
            torch.tensor(cols, dtype=torch.long),
            torch.tensor(pages, dtype=torch.long),
        )

    def _grow(self, need: int) -> None:
        width = self.width
        while width < need:
            width *= 2
        wider = torch.full((self.table.shape[0], width), self.null_page, dtype=torch.long, device=self.device)
        wider[:, : self.width] = self.table
        self.table = wider

    def apply(self, update: TableUpdate) -> None:
        """Write the update's entries (tensors on the table's device)."""
        if update.rows.numel():
            self.table.index_put_((update.rows, update.cols), update.pages)

    def gather(
        self, slots: torch.Tensor, first: torch.Tensor, count: torch.Tensor, width: int
    ) -> torch.Tensor:
        """``[B, width]`` page table: row b holds entries ``first[b] .. first[b] + count[b] - 1`` of
        slot ``slots[b]``'s row, then the null page (all three ``[B]`` tensors on the device)."""
        B = slots.shape[0]
        if width == 0:
            return torch.empty((B, 0), dtype=torch.long, device=self.device)
        col = torch.arange(width, device=self.device).view(1, width)
        flat = slots.view(B, 1) * self.width + (first.view(B, 1) + col).clamp_(max=self.width - 1)
        got = self.table.view(-1).index_select(0, flat.view(-1)).view(B, width)
        return torch.where(col < count.view(B, 1), got, self.null_page)
