"""The whole decode step in one CUDA graph per batch bucket: dense parts, attention, KV store, page flush.

The piecewise graphs (`cuda_graph.py`) replay 33 graphs a step and launch each layer's attention, KV
store and page flush from Python between them: on an H200 at batch 256 those launches took 9.8 ms of
host time a step (the served fp8 run's step timeline), more than half of the 18.6 ms the GPU needs.
Here they are captured too (SGLang captures its decode step the same way), so a decode step is its
plan (`build_step`, as every step), a few copies of the plan's index tensors into static buffers
(`StaticDecodeStep.load`) and one replay.

What the kernels read is one static `StepBatch` per bucket, views of buffers sized for the largest
bucket (the SGLang plugin's `DecodeGraphState` keeps the same layout for its graphs):

- the cold page table ``[B, W]``, W the pages of the longest context the model takes: the attention
  kernel's split-KV choice (a launch argument baked into the graph) follows the table's width, so it
  is fixed per bucket; the kernel reads only each entry's lengths (int32 ``[3, B]``: cold pages, ring
  rows, sink flag), and columns past an entry's cold pages are never read;
- the ring rows ``[B, R]`` (R the ring's capacity) and, with sinks, the sink table ``[B]``;
- one completed page per entry (a decode step completes at most one a sequence): its page id, its
  ``P`` source rows and its sink slot. Entries that complete none have page id `NO_PAGE`, and the
  page-quantize kernel's programs for them return at once, so its grid is static;
- one ring write per entry; an entry whose token does not stay in the ring, and every padding entry,
  writes the ring's scratch row (`HotRing.scratch_row`, never read).

A batch is padded to its bucket; padding entries have zero lengths (each attends to its own new token
only) and write nothing but the scratch row. `FullDecodeGraphs.use_pieces` runs the same step eagerly
on the static buffers (any device, the Triton kernels interpreted on CPU), which the tests compare with
the piecewise and eager engines token for token.

With an image pool (a vision-language model whose text pages are quantized) or the drift fallback's
raised pool (present whenever the drift monitor is on), a step that reads or writes a page of those
pools adds a kernel pass and a page split the static step does not hold: the graphs then capture the
piecewise pieces too, into the same memory pool, and a step that does not fit the static step replays
them around eager attention (`DecodeGraphs.step`). A step whose batch holds no image or raised page is
one replay of the whole step. Raised pages are written while the fallback level is raised, and also at
level 0 once the text pool is full (`StratifiedKVCache._alloc_text`); they stay in running sequences
and cached prefixes after the level comes down, and one such sequence puts its whole batch on the
pieces.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.cuda_graph import DecodeGraphs, decode_graphs_for, graphs_wanted, release_warmup_blocks
from kvstrata.engine.model import Transformer
from kvstrata.radix.plan import NO_PAGE, StepBatch, static_decode_step

log = logging.getLogger("kvstrata.engine")
MIN_WIDTH = 32  # the narrowest page-table width class (a decode launch splits from 2 x 16-32 pages on)
GRAPH_MODES = ("full", "piecewise")


def full_graph_unsupported(backend_name: str, scales: bool) -> str | None:
    """Why the full decode graph cannot capture an engine's steps (the piecewise graphs run instead),
    or None: its attention backend, and whether its cache has static KV scales. (An image pool or a
    raised pool does not stop it: the steps over their pages replay the piecewise pieces.)"""
    if backend_name != "triton":
        return f"the {backend_name} attention backend is not captured (the triton backend is)"
    if scales:
        return "static KV scales (a calibration file) count clipped elements on the host"
    return None


def cache_unsupported(cache: Any, backend_name: str) -> str | None:
    """`full_graph_unsupported` for a built cache."""
    scales = any(clip is not None for pair in cache.clips for clip in pair)
    return full_graph_unsupported(backend_name, scales)


def width_classes(max_width: int) -> list[int]:
    """Page-table widths captured per bucket: 32, 64, 128, ... pages and ``max_width``. A step replays
    the graph of the narrowest class that holds its longest history, so the split-KV choice made for the
    class's width (baked into the graph) stays within 2x of the one an eager step makes for its own."""
    widths = []
    width = MIN_WIDTH
    while width < max_width:
        widths.append(width)
        width *= 2
    return [*widths, max_width]


def static_step_bytes(max_bs: int, max_context: int, page_size: int, ring_capacity: int) -> int:
    """Bytes of `StaticDecodeStep`'s buffers: int64 page table, ring rows, page sources and a few
    ids per entry, int32 lengths."""
    width = -(-max_context // page_size)
    return max_bs * (8 * (width + ring_capacity + page_size + 5) + 4 * 3)


class StaticDecodeStep:
    """The static buffers of the full decode graph's steps and the `StepBatch` of each bucket over them."""

    def __init__(self, cache: Any, max_bs: int, max_context: int) -> None:
        P, R, B = cache.page_size, cache.ring.capacity, max_bs
        dev, nulls = cache.device, cache.nulls
        self.max_bs, self.page_size = B, P
        self.width = -(-max_context // P)
        self.widths = width_classes(self.width)
        self.null_sink, self.null_page = nulls.sink, nulls.page
        self.scratch_row = cache.ring.scratch_row

        def ids(*shape: int, fill: int) -> Tensor:
            return torch.full(shape, fill, dtype=torch.long, device=dev)

        self.page_table = ids(B, self.width, fill=nulls.page)
        self.lengths = torch.zeros((3, B), dtype=torch.int32, device=dev)
        self.ring_rows = ids(B, R, fill=nulls.ring_row)
        self.sink_table = ids(B, fill=nulls.sink) if cache.sinks is not None else None
        self.page_ids = ids(B, fill=NO_PAGE)
        self.sources = ids(B * P, fill=nulls.ring_row)
        self.sink_slots = ids(B, fill=-1)
        # `quantize_pages` reads only its size: sinks are filled (per page, by sink_slots) when non-empty
        self.sink_pages = ids(1 if cache.sinks is not None else 0, fill=0)
        self.ring_dst = ids(B, fill=self.scratch_row)
        self.ring_src = torch.arange(B, dtype=torch.long, device=dev)
        self.steps: dict[tuple[int, int], StepBatch] = {}

    def width_for(self, batch: StepBatch) -> int:
        """The width class of ``batch`` (one that `fits`): the narrowest at or above its page table's."""
        return self.widths[bisect.bisect_left(self.widths, batch.groups[0].page_table.shape[1])]

    def step_for(self, bs: int, width: int) -> StepBatch:
        """The static step of bucket ``bs`` and width class ``width``: the same tensors (and objects)
        in every step."""
        step = self.steps.get((bs, width))
        if step is None:
            if not 1 <= bs <= self.max_bs:
                raise ValueError(f"full decode graph: batch of {bs} outside 1..{self.max_bs}")
            if width not in self.widths:
                raise ValueError(f"full decode graph: width {width} is not one of {self.widths}")
            step = self.steps[bs, width] = self._static_step(bs, width)
        return step

    def _static_step(self, bs: int, width: int) -> StepBatch:
        """A `StepBatch` as the Triton kernels read it (lengths, not the host lists, which stay
        placeholders of size ``bs``)."""
        return static_decode_step(
            page_table=self.page_table[:bs, :width],
            sink_table=self.sink_table[:bs] if self.sink_table is not None else None,
            ring_rows=self.ring_rows[:bs],
            lengths=self.lengths[:, :bs],
            page_size=self.page_size,
            page_ids=self.page_ids[:bs],
            sink_pages=self.sink_pages,
            sink_slots=self.sink_slots[:bs],
            ring_dst=self.ring_dst[:bs],
            ring_src=self.ring_src[:bs],
            sources=self.sources[: bs * self.page_size],
        )

    def fits(self, batch: StepBatch) -> bool:
        """Whether ``batch`` (a decode step's plan from `build_step`) loads into the static step."""
        if len(batch.groups) != 1 or batch.num_tokens > self.max_bs:
            return False
        g, w = batch.groups[0], batch.write
        return (
            g.tokens == 1
            and g.rows is None
            and g.image_table is None
            and g.raised_table is None
            and w.image_split is None
            and w.raised_split is None
            and g.page_table.shape[1] <= self.width
            and g.ring_rows.shape[1] <= self.ring_rows.shape[1]
            and (g.sink_table is None or self.sink_table is not None)
        )

    def load(self, batch: StepBatch, bs: int, width: int) -> StepBatch:
        """Copy ``batch``'s index tensors (on the device already) into the static step of bucket ``bs``
        and width class ``width`` (device copies, queued without a host sync); entries past the batch
        become padding."""
        g, w = batch.groups[0], batch.write
        n = g.batch
        step = self.step_for(bs, width)
        cols = g.page_table.shape[1]
        self.page_table[:n, :cols].copy_(g.page_table)
        # A partial cold tile reads the table past an entry's pages (their keys masked, their values
        # times 0): the null page there, as in the plan's own table, not an older step's pages.
        self.page_table[:n, cols:width].fill_(self.null_page)
        self.ring_rows[:n, : g.ring_rows.shape[1]].copy_(g.ring_rows)
        self.lengths[:, :n].copy_(g.lengths if g.lengths is not None else g.kernel_lengths)  # to int32
        if n < bs:
            self.lengths[:, n:bs].zero_()
        if self.sink_table is not None:
            if g.sink_table is None:
                self.sink_table[:n].fill_(self.null_sink)
            else:
                self.sink_table[:n].copy_(g.sink_table)
        done = w.page_ids.numel()  # pages completed, at most one an entry
        self.page_ids[done:bs].fill_(NO_PAGE)
        if done:
            self.page_ids[:done].copy_(w.page_ids)
            self.sources.index_copy_(0, w.from_ring[0], w.from_ring[1])
            self.sources.index_copy_(0, w.from_new[0], -1 - w.from_new[1])
        if self.sink_table is not None:
            self.sink_slots[:bs].fill_(-1)
            if w.sink_pages.numel():
                self.sink_slots.index_copy_(0, w.sink_pages, w.sink_slots)
        if w.ring_src.numel() == n:  # every entry's token stays in the ring (decode): rows 0..n-1
            self.ring_dst[:n].copy_(w.ring_dst)
            self.ring_dst[n:bs].fill_(self.scratch_row)
        else:
            self.ring_dst[:bs].fill_(self.scratch_row)
            self.ring_dst.index_copy_(0, w.ring_src, w.ring_dst)
        return step


class FullDecodeGraphs(DecodeGraphs):
    """One captured graph per bucket of the whole decode step (`DecodeGraphs`' dense pieces with each
    layer's attention and KV store between them, on the static step)."""

    def __init__(self, net: Transformer, max_bs: int, cache: Any, backend: Any, max_context: int) -> None:
        why = cache_unsupported(cache, backend.name)
        if why is not None:
            raise ValueError(f"full decode graph: {why}")
        super().__init__(net, max_bs)
        self.cache = cache
        self.backend = backend
        self.static = StaticDecodeStep(cache, self.max_bs, max_context)
        # What runs each (bucket, width class)'s step: a captured graph's replay, or the step itself.
        self.whole: dict[tuple[int, int], Callable[[], None]] = {}
        # Steps over the image or the raised pool do not fit the static step: the piecewise pieces run those.
        self.with_pieces = cache.image_pool is not None or cache.raised_pool is not None
        self.piecewise_steps = 0  # steps that replayed the pieces (`DecodeGraphs.step`) instead

    def _step_fn(self, bs: int, width: int) -> Callable[[], None]:
        """The whole step of bucket ``bs``, width class ``width``, on the static buffers (what a graph
        captures)."""
        step = self.static.step_for(bs, width)
        attn = self.backend.bind(step)
        pieces = self._piece_fns(bs)
        q, k, v, out = self.q[:bs], self.k[:bs], self.v[:bs], self.attn_out[:bs]

        def run() -> None:
            step.layers_done.clear()  # the static step is every step's: `attention` checks its layers
            pieces[0]()
            for layer, piece in enumerate(pieces[1:]):
                attn(layer, q, k, v, out=out)  # type: ignore[call-arg]
                piece()

        return run

    def _keys(self) -> list[tuple[int, int]]:
        """(bucket, width class) of every graph, largest first."""
        return [(bs, w) for bs in reversed(self.sizes) for w in reversed(self.static.widths)]

    def use_pieces(self) -> None:
        """Run each step eagerly on the static buffers instead of replaying (any device)."""
        self.whole = {key: self._step_fn(*key) for key in self._keys()}
        if self.with_pieces:
            super().use_pieces()

    @torch.inference_mode()
    def capture(self) -> None:
        """Run every bucket's step once (Triton compiles its kernel variants, cuBLAS makes its
        workspaces), then capture each, largest first. The static step's padding reads no history and
        writes only the ring's scratch row, so these runs leave the cache as it was."""
        if self.x.device.type != "cuda":
            raise ValueError("CUDA graphs need the model on a CUDA device")
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()  # the pieces' capture too: one cuBLAS workspace for both
        if self.with_pieces:  # never replayed together with a whole step: one pool for both
            super().capture(pool, stream)
        self.cache.prepare_graph_capture()
        steps = {key: self._step_fn(*key) for key in self._keys()}
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for fn in steps.values():
                fn()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        for key, fn in steps.items():
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
                fn()
            self.whole[key] = graph.replay
        torch.cuda.synchronize()
        release_warmup_blocks()

    def step(
        self,
        ids: list[int],
        positions: list[int],
        batch: StepBatch,
        bind: Callable[[StepBatch], Any],
        fill: Callable[[Tensor], None] | None = None,
    ) -> Tensor | None:
        """One decode step in one replay: float32 logits ``[n, V]`` (a view of the static buffer). A
        ``batch`` that does not fit the static step replays the piecewise pieces where they were
        captured (`with_pieces`), else returns None (the caller runs it eager)."""
        bs = self.bucket(len(ids))
        if bs is None:
            return None
        if not self.static.fits(batch):
            if not self.with_pieces:
                return None
            self.piecewise_steps += 1
            return super().step(ids, positions, batch, bind, fill)
        width = self.static.width_for(batch)
        n = self.load_inputs(ids, positions, fill)
        self.static.load(batch, bs, width)
        self.whole[bs, width]()
        self.cache.graph_step_ran(batch)
        self.replayed_steps += 1
        return self.logits[:n]


def full_graph_memory_bytes(
    cfg: ModelConfig, max_bs: int, max_context: int, page_size: int, ring: int
) -> int:
    """What the full graph holds beyond the piecewise graphs' estimate: the static step, and the split
    partials of one layer's attention in the graphs' pool (`memory.split_partial_bytes`)."""
    from kvstrata.engine.memory import split_partial_bytes

    static = static_step_bytes(max_bs, max_context, page_size, ring)
    return static + split_partial_bytes(cfg, max_bs, 0)


def decode_graphs(
    net: Transformer, disable: bool, max_bs: int, mode: str, cache: Any, backend: Any, max_context: int
) -> DecodeGraphs | None:
    """The engine's captured decode graphs: the whole step (``mode`` "full") where the cache allows it,
    else piecewise; None when graphs are off (disabled, not on CUDA, or unsupported)."""
    if mode not in GRAPH_MODES:
        raise ValueError(f"cuda_graph_mode must be one of {GRAPH_MODES}, got {mode!r}")
    if not graphs_wanted(net, disable):
        return None
    why = cache_unsupported(cache, backend.name) if mode == "full" else "piecewise asked for"
    if why is not None:
        if mode == "full":
            log.info("full decode graph off (%s): piecewise graphs", why)
        return decode_graphs_for(net, disable, max_bs)
    start = time.perf_counter()
    graphs = FullDecodeGraphs(net, max_bs, cache, backend, max_context)
    try:
        graphs.capture()
        captured = True
    except RuntimeError as e:  # out of memory among them: the engine still starts, on the piecewise graphs
        log.warning("whole-step decode graphs failed to capture (%s): piecewise graphs", e)
        captured = False
    if not captured:
        # Outside the except block: its traceback held the capture's frame and so the graphs and their
        # pool, which must be freed before the piecewise graphs are captured again.
        del graphs
        torch.cuda.empty_cache()
        return decode_graphs_for(net, disable, max_bs)
    log.info(
        "captured whole-step decode CUDA graphs for batch sizes %s in %.1f s%s",
        graphs.sizes,
        time.perf_counter() - start,
        " (and the piecewise pieces, for steps over image or raised pages)" if graphs.with_pieces else "",
    )
    return graphs


def graph_kind(graphs: DecodeGraphs | None) -> str:
    """What decode steps replay: "full", "piecewise" or "off" (the server info's ``cuda_graphs``)."""
    if graphs is None:
        return "off"
    return "full" if isinstance(graphs, FullDecodeGraphs) else "piecewise"
