"""The full decode graph's step run eagerly on its static buffers (`FullDecodeGraphs.use_pieces`, the
Triton kernels interpreted on CPU) gives the eager engine's and the piecewise graphs' greedy tokens,
token for token: mixed lengths, padding rows (batches between buckets), pages completed while
decoding, both page-table width classes, fp8 and unquantized history, with and without sinks, with
overlap scheduling."""

from __future__ import annotations

import os

import pytest
import tiny_models
import torch
from graph_steps import DRIFT_ON, rounds_at_levels

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from kvstrata.engine.cuda_graph import DecodeGraphs  # noqa: E402
from kvstrata.engine.engine import Engine  # noqa: E402
from kvstrata.engine.full_graph import (  # noqa: E402
    NO_PAGE,
    FullDecodeGraphs,
    StaticDecodeStep,
    decode_graphs,
    full_graph_unsupported,
    graph_kind,
    width_classes,
)
from kvstrata.engine.loader import load_model  # noqa: E402
from kvstrata.engine.options import EngineArgs  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NEW = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tiny_models.save_hf(tiny_models.hf_model("llama3"), tmp_path_factory.mktemp("llama3"))
    return load_model(path, dtype=torch.float32, device=DEVICE)


def prompts(n: int, seed: int) -> list[list[int]]:
    """``n`` prompts of 5 to 40 tokens, the first one of 140 (past 32 pages of 4 tokens: width class 48)."""
    g = torch.Generator().manual_seed(seed)
    lengths = [140, *torch.randint(5, 40, (n - 1,), generator=g).tolist()][:n]
    return [torch.randint(4, 300, (length,), generator=g).tolist() for length in lengths]


def engine_for(model, kv_cache_dtype: str, sinks: bool, **extra) -> Engine:
    return Engine(
        model=model,
        attention_backend="triton",
        kv_cache_dtype=kv_cache_dtype,
        kv_plan="off",
        recent_window=8,
        sinks=sinks,
        page_size=4,
        max_total_tokens=2048,
        max_running_requests=8,
        disable_cuda_graph=True,
        **extra,
    )


def stored(cache) -> list[torch.Tensor]:
    """Copies of what the steps wrote: every cold page (codes and scales) and sink page, and the ring
    without its scratch row (which only the full graph's padding writes)."""
    parts = [t.clone() for bufs in (*cache.pool.k, *cache.pool.v) for t in bufs.values()]
    if cache.sinks is not None:
        parts += [cache.sinks.k.clone(), cache.sinks.v.clone()]
    rows = cache.ring.scratch_row
    return [*parts, cache.ring.k[:, :rows].clone(), cache.ring.v[:, :rows].clone()]


def greedy(model, mode: str, kv_cache_dtype: str, sinks: bool, ps: list[list[int]], overlap: bool = False):
    """Greedy outputs with ``mode``: "eager", "piecewise" or "full" (graphs' steps run eagerly on
    their static buffers, buckets 1, 2, 4), and the steps the graphs ran. ``overlap``: overlap
    scheduling forced on (the ids of the step before filled on the device)."""
    engine = engine_for(model, kv_cache_dtype, sinks)
    engine.core.overlap = overlap  # read by the engine thread at each step; no request is running yet
    try:
        net = model.net
        if mode == "piecewise":
            engine.runner.graphs = DecodeGraphs(net, 4)
        elif mode == "full":
            # page tables of 32 and 48 pages: both below the 64 a decode launch splits from, so the
            # graph's attention splits as the eager step's does (not at all) and stores the same bits
            engine.runner.graphs = FullDecodeGraphs(net, 4, engine.cache, engine.runner.backend, 192)
            assert engine.runner.graphs.static.widths == [32, 48]
        if engine.runner.graphs is not None:
            engine.runner.graphs.use_pieces()
        params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
        outs = engine.generate(input_ids=ps, sampling_params=params)
        stats = engine.check_invariants()  # the ring's null row is still zero, pages as written
        assert stats.running == 0
        steps = engine.runner.graphs.replayed_steps if engine.runner.graphs is not None else 0
        return [o["output_ids"] for o in outs], steps, stored(engine.cache)
    finally:
        engine.shutdown()


@pytest.mark.parametrize(
    "kv_cache_dtype, sinks, batch",
    [("fp8_e4m3", False, 3), ("fp8_e4m3", True, 4), ("auto", False, 1)],
)
def test_full_step_equals_piecewise_and_eager(tiny, kv_cache_dtype, sinks, batch, monkeypatch):
    from kvstrata.radix.kernels.attend import DECODE_LAUNCH

    # A launch of few programs splits from 16 pages (`attend.split_floor`), so the graph, whose plans
    # are as wide as its page table, would split where the eager step over fewer pages does not: off
    # here, so that both split alike and store the same bits.
    for launch in DECODE_LAUNCH.values():
        monkeypatch.setitem(launch, "fill_programs", 0)
    ps = prompts(batch, seed=batch)
    overlap = batch == 3
    eager, _, _ = greedy(tiny, "eager", kv_cache_dtype, sinks, ps, overlap)
    piecewise, piece_steps, piece_kv = greedy(tiny, "piecewise", kv_cache_dtype, sinks, ps, overlap)
    full, full_steps, full_kv = greedy(tiny, "full", kv_cache_dtype, sinks, ps, overlap)
    assert full == piecewise == eager
    assert full_steps >= NEW - 1 and piece_steps >= NEW - 1  # every decode step ran in the graphs
    # what the steps stored, bit for bit (the same kernels, split alike, on the same plans)
    assert all(torch.equal(a, b) for a, b in zip(full_kv, piece_kv, strict=True))


def test_static_step_load_pads_and_marks_no_page(tiny):
    """A loaded decode step: the plan's entries, then padding (zero lengths, NO_PAGE, the scratch
    row); the entry that completes a page has its page id and sources, the others NO_PAGE."""
    engine = engine_for(tiny, "fp8_e4m3", sinks=False)
    try:
        cache = engine.cache
        H, D = cache.cfg.kv_heads, cache.cfg.head_dim
        seqs = [cache.admit(list(range(1, n + 2))) for n in (7, 10, 12)]
        for n_new in ([7, 10, 12], [1, 1, 1]):
            batch = cache.begin_step(seqs, n_new)
            if n_new[0] == 1:
                break
            T = sum(n_new)
            for layer in range(cache.cfg.num_layers):
                q, k, v = (torch.randn(T, H, D, device=DEVICE) for _ in range(3))
                cache.attention(layer, batch, q, k, v, 1.0)
            cache.end_step(batch)
        static = StaticDecodeStep(cache, 4, 256)
        static.page_table.fill_(5)  # an older step's pages
        step = static.load(batch, 4, static.width_for(batch))
        g, w = batch.groups[0], batch.write
        cols = g.page_table.shape[1]
        assert static.width_for(batch) == 32 and step.groups[0].page_table.shape == (4, 32)
        assert torch.equal(step.groups[0].page_table[:3, :cols], g.page_table)
        assert bool((step.groups[0].page_table[:3, cols:] == cache.nulls.page).all())
        assert step.groups[0].kernel_lengths[:, :3].tolist() == g.kernel_lengths.tolist()
        assert step.groups[0].kernel_lengths[:, 3].tolist() == [0, 0, 0]
        assert w.page_ids.numel() == 1  # length 7 -> 8 completes its second page
        assert step.write.page_ids.tolist() == [w.page_ids.item(), NO_PAGE, NO_PAGE, NO_PAGE]
        P = cache.page_size
        assert torch.equal(step.write.kernel_sources(P)[:P], w.kernel_sources(P))
        assert step.write.ring_dst.tolist() == [*w.ring_dst.tolist(), cache.ring.scratch_row]
        cache.cancel_step(batch)
    finally:
        engine.shutdown()


def test_decode_graphs_off_on_cpu_and_modes_checked(tiny):
    if tiny.net.device.type != "cuda":  # (the CUDA run of this file: the model is on the GPU)
        assert decode_graphs(tiny.net, False, 4, "full", None, None, 256) is None  # nothing captured
    assert decode_graphs(tiny.net, True, 4, "full", None, None, 256) is None  # disabled
    with pytest.raises(ValueError, match="cuda_graph_mode"):
        decode_graphs(tiny.net, False, 4, "whole", None, None, 256)
    assert graph_kind(None) == "off"


def test_width_classes_and_support():
    assert width_classes(32) == [32]
    assert width_classes(20) == [20]
    assert width_classes(100) == [32, 64, 100]
    assert width_classes(128) == [32, 64, 128]
    assert full_graph_unsupported("triton", False) is None
    assert "torch" in full_graph_unsupported("torch", False)
    assert "scales" in full_graph_unsupported("triton", True)
    assert EngineArgs().cuda_graph_mode == "full"  # the default (served on the H200)
    with pytest.raises(ValueError, match="cuda_graph_mode"):
        EngineArgs(cuda_graph_mode="whole").validate()
    assert NO_PAGE < 0


def test_a_failed_capture_falls_back_to_piecewise_graphs(tiny, monkeypatch, caplog):
    """Whole-step graphs that fail to capture (out of memory among them) leave the engine on the
    piecewise graphs, with a warning, instead of failing its start."""
    from types import SimpleNamespace

    from kvstrata.engine import full_graph

    class Failing:
        def __init__(self, *args):
            pass

        def capture(self):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")

    piecewise = object()
    monkeypatch.setattr(full_graph, "graphs_wanted", lambda net, disable: True)
    monkeypatch.setattr(full_graph, "FullDecodeGraphs", Failing)
    monkeypatch.setattr(full_graph, "decode_graphs_for", lambda net, disable, max_bs: piecewise)
    cache = SimpleNamespace(clips=[], image_pool=None, raised_pool=None)
    backend = SimpleNamespace(name="triton")
    with caplog.at_level("WARNING", logger="kvstrata.engine"):
        got = full_graph.decode_graphs(tiny.net, False, 4, "full", cache, backend, 256)
    assert got is piecewise
    assert "failed to capture" in caplog.text


def raised_greedy(model, mode: str, rounds: list[list[list[int]]]):
    """Greedy outputs of ``rounds`` of prompts, the first at fallback level 0, the others at level 1
    (new text pages in the raised pool), with ``mode`` "eager" or "full" (the whole-step graphs'
    pieces run eagerly); and (whole steps, piecewise steps) of the graphs per round."""
    engine = engine_for(model, "fp8_e4m3", False, **DRIFT_ON)
    try:
        assert engine.cache.raised_pool is not None
        graphs = None
        if mode == "full":
            graphs = FullDecodeGraphs(model.net, 4, engine.cache, engine.runner.backend, 192)
            assert graphs.with_pieces
            graphs.use_pieces()
            engine.runner.graphs = graphs
        outs, counts = rounds_at_levels(engine, graphs, rounds, NEW)
        stats = engine.check_invariants()
        assert stats.running == 0
        assert engine.cache.raised  # level 1 reached the cache
        return outs, counts
    finally:
        engine.shutdown()


def test_full_graph_with_a_raised_pool_replays_pieces_for_raised_steps(tiny):
    """With the drift monitor's raised pool the whole-step graphs are still used: at fallback level 0
    every decode step is one whole step; at level 1 the steps that write or read raised pages replay
    the piecewise pieces around eager attention. Same greedy tokens as the eager engine throughout."""
    first, second = prompts(3, seed=11), prompts(3, seed=12)
    rounds = [first, second, first]  # the last re-reads the first round's level-0 pages (a prefix hit)
    eager, _ = raised_greedy(tiny, "eager", rounds)
    full, counts = raised_greedy(tiny, "full", rounds)
    assert full == eager
    # (whole steps, piecewise steps, past the end) per round; NEW - 1 decode steps a round (the first
    # token is prefill's), no overlap scheduling on CPU
    assert counts[0] == (NEW - 1, 0, 0)  # level 0: every decode step whole
    assert counts[1] == (0, NEW - 1, 0)  # level 1, new prompts: their pages are raised from prefill on
    whole, pieces, _ = counts[2]  # level 1 over level-0 pages: whole until a step completes a raised page
    assert whole + pieces == NEW - 1 and whole > 0 and pieces > 0
