"""Decode steps of ``--attention-backend kvstrata`` inside SGLang's CUDA graphs.

SGLang captures a decode forward once per batch bucket and replays it: every tensor the kernels
read must live at the same address in every replay, with the same shapes. `DecodeGraphState` keeps
one static `StepBatch` per bucket, all views of buffers sized for the largest bucket:

- the host plans each replayed step (`RingBook.plan_decode`: a few integers per entry: its row,
  lengths, where its ring starts, which page it completes, which ring row takes its new token) and
  `load` puts it on the device in one asynchronous copy from pinned memory into ``inputs``;
- `gather` (recorded in the graph) turns ``inputs`` into what the kernels read: every entry's page
  table, read from SGLang's ``req_to_token`` on the device (the host never reads it), the id of the
  page each entry completes (`NO_PAGE` when none), every entry's ring rows
  (``[bs, ring capacity]``) and the ring rows of the page it completes, and the int32 lengths.

The page table is as wide as a request can be long, so the attention kernel's split-KV choice is
fixed per bucket; the kernel reads only each entry's ``lengths``. The page-quantize grid has one
program per entry (its size is static); an entry that completes no page (15 of 16 decode steps of a
request at page size 16) has page id `NO_PAGE`, and its programs return at once without writing
any page.
"""

from __future__ import annotations

import torch

from kvstrata.integrations.sglang.step import DecodePlan
from kvstrata.radix.plan import NO_PAGE, StepBatch, static_decode_step

STAGING_BUFFERS = 2  # pinned host buffers used in turn, each reused only after its copy is done


class DecodeGraphState:
    def __init__(
        self,
        max_bs: int,
        max_context: int,
        page_size: int,
        ring_capacity: int,
        null_ring_row: int,
        device: torch.device,
    ) -> None:
        B, R, P = max_bs, ring_capacity, page_size
        self.max_bs, self.page_size, self.ring_capacity = B, P, R
        self.device = torch.device(device)
        self.width = -(-max_context // P)
        # Sections of the flat int64 input, each sized for max_bs entries.
        self.sections = {
            "rows": (B,),
            "page_col": (B,),
            "complete": (B,),
            "lengths": (3, B),
            "ring_start": (B,),
            "ring_base": (B,),
            "ring_dst": (B,),
        }
        sizes = [_numel(shape) for shape in self.sections.values()]
        self.inputs = torch.zeros(sum(sizes), dtype=torch.long, device=self.device)
        self.views = {
            name: part.view(shape)
            for (name, shape), part in zip(self.sections.items(), self.inputs.split(sizes), strict=True)
        }
        on_cuda = self.device.type == "cuda"
        self.staging = [
            torch.zeros(sum(sizes), dtype=torch.long, pin_memory=on_cuda) for _ in range(STAGING_BUFFERS)
        ]
        self.staged = [
            dict(zip(self.sections, part.split(sizes), strict=True)) for part in self.staging
        ]  # flat parts of each staging buffer
        self.copied: list[torch.cuda.Event | None] = [None] * STAGING_BUFFERS
        self.turn = 0
        self.page_table = torch.zeros((B, self.width), dtype=torch.int32, device=self.device)
        self.lengths = torch.zeros((3, B), dtype=torch.int32, device=self.device)
        self.page_ids = torch.zeros(B, dtype=torch.long, device=self.device)
        self.ring_rows = torch.zeros((B, R), dtype=torch.long, device=self.device)
        self.sources = torch.zeros(B * P, dtype=torch.long, device=self.device)
        self.null_row = torch.tensor(null_ring_row, dtype=torch.long, device=self.device)
        self.no_page = torch.tensor(NO_PAGE, dtype=torch.long, device=self.device)
        self.ring_cols = torch.arange(R, device=self.device).view(1, R)
        self.page_rows = torch.arange(P, device=self.device).view(1, P)
        self.new_rows = -1 - torch.arange(B, device=self.device).view(B, 1)  # `WritePlan.kernel_sources`
        self.sink_slots = torch.full((B,), -1, dtype=torch.long, device=self.device)
        self.ring_src = torch.arange(B, dtype=torch.long, device=self.device)
        self.steps: dict[int, StepBatch] = {}

    def step_for(self, bs: int) -> StepBatch:
        """The static step of bucket ``bs``: views of the buffers, the same objects in every replay."""
        step = self.steps.get(bs)
        if step is None:
            if not 1 <= bs <= self.max_bs:
                raise ValueError(f"kvstrata graphs: batch of {bs} outside 1..{self.max_bs}")
            step = _static_step(self, bs)
            self.steps[bs] = step
        return step

    def narrowed(self, bs: int, pages: int) -> StepBatch:
        """A step of ``bs`` entries over the buffers whose page table shows only its first ``pages``
        columns (an eager step: the attention kernel splits the history by the table's width, so a
        table as wide as the longest possible request would split a short history into mostly empty
        parts). Not cached: an eager step's ``pages`` changes as its requests grow."""
        if not 1 <= pages <= self.width:
            raise ValueError(f"kvstrata: a page table of {pages} columns outside 1..{self.width}")
        self.step_for(bs)  # checks bs
        return _static_step(self, bs, pages)

    def load(self, plan: DecodePlan) -> StepBatch:
        """Copy a planned step into the inputs (one copy, asynchronous on CUDA); its static step."""
        bs = plan.rows.numel()
        step = self.step_for(bs)
        turn = self.turn
        self.turn = (turn + 1) % STAGING_BUFFERS
        event = self.copied[turn]
        if event is not None:
            event.synchronize()  # the copy of two steps ago; long done in practice
        staged = self.staged[turn]
        for name, shape in self.sections.items():
            dst = staged[name].view(shape)
            src = getattr(plan, name)
            if len(shape) == 1:
                dst[: src.numel()].copy_(src)
            elif name == "lengths":
                dst[:, :bs].copy_(src)
            else:
                dst[:bs].copy_(src)
        self.inputs.copy_(self.staging[turn], non_blocking=True)
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self.copied[turn] = event
        return step

    def gather(self, bs: int, req_to_token: torch.Tensor) -> None:
        """Device ops of a step of bucket ``bs`` (recorded in the graph; no host read): page tables
        from ``req_to_token``, completed page ids, ring rows, the sources of completed pages, int32
        lengths."""
        P, R, v = self.page_size, self.ring_capacity, self.views
        table = self.page_table[:bs]
        torch.index_select(req_to_token[:, ::P], 0, v["rows"][:bs], out=table)
        table.floor_divide_(P)
        page_col, complete = v["page_col"][:bs].view(bs, 1), v["complete"][:bs]
        done = torch.gather(table, 1, page_col).view(bs).to(torch.long)
        torch.where(complete.bool(), done, self.no_page, out=self.page_ids[:bs])
        self.lengths[:, :bs].copy_(v["lengths"][:, :bs])
        # Ring rows of positions [ring_start, L): rows base + (ring_start + j) % R, then the null row.
        base, start = v["ring_base"][:bs].view(bs, 1), v["ring_start"][:bs].view(bs, 1)
        held = self.ring_cols < v["lengths"][1, :bs].view(bs, 1)
        torch.where(held, base + (start + self.ring_cols) % R, self.null_row, out=self.ring_rows[:bs])
        # Page of position L = page_col * P + P - 1: its first P - 1 rows from the ring, the last the new row.
        from_ring = base + (page_col * P + self.page_rows) % R
        rows = torch.where(self.page_rows < P - 1, from_ring, self.new_rows[:bs])
        sources = self.sources[: bs * P].view(bs, P)
        torch.where(complete.view(bs, 1).bool(), rows, self.null_row, out=sources)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _static_step(state: DecodeGraphState, bs: int, pages: int | None = None) -> StepBatch:
    """A `StepBatch` of ``bs`` decode entries over the state's buffers, as the Triton kernels read it
    (``lengths`` instead of host lists and masks; the host lists stay empty placeholders of size bs);
    ``pages``: the page table's first columns only (all by default)."""
    P = state.page_size
    return static_decode_step(
        page_table=state.page_table[:bs, :pages],
        sink_table=None,
        ring_rows=state.ring_rows[:bs],
        lengths=state.lengths[:, :bs],
        page_size=P,
        page_ids=state.page_ids[:bs],
        sink_pages=torch.empty(0, dtype=torch.long, device=state.device),
        sink_slots=state.sink_slots[:bs],  # no sinks inside SGLang
        ring_dst=state.views["ring_dst"][:bs],
        ring_src=state.ring_src[:bs],
        sources=state.sources[: bs * P],
    )
