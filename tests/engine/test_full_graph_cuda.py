"""CUDA: the whole decode step captured in one graph per bucket (``cuda_graph_mode="full"``) gives the
eager engine's greedy tokens, token for token, at batch sizes on and between the buckets and above the
largest (those steps run eager), with unquantized and fp8 history, with sinks, under overlap
scheduling (ids of the step before filled on the device), and leaves the cache clean; its memory stays
within the plan's estimate."""

from __future__ import annotations

import gc

import pytest
import torch
from graph_steps import DRIFT_ON, rounds_at_levels
from tiny_models import random_prompts as prompts

from kvstrata.engine.cuda_graph import graph_memory_bytes
from kvstrata.engine.engine import Engine
from kvstrata.engine.full_graph import FullDecodeGraphs, full_graph_memory_bytes
from kvstrata.engine.loader import load_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

NEW = 40


def greedy(model, kv_cache_dtype: str, mode: str | None, ps, sinks: bool = False, overlap: bool = True):
    """Greedy outputs; ``mode`` None: no graphs; the steps the graphs replayed."""
    engine = Engine(
        model=model,
        attention_backend="triton",
        kv_cache_dtype=kv_cache_dtype,
        kv_plan="off",
        recent_window=16,
        sinks=sinks,
        page_size=16,
        max_total_tokens=4096,
        max_running_requests=16,
        cuda_graph_max_bs=12,  # buckets 1, 2, 4, 8, 12; 13..16 sequences run eager
        cuda_graph_mode=mode or "piecewise",
        disable_cuda_graph=mode is None,
        disable_overlap_schedule=not overlap,
    )
    try:
        graphs = engine.runner.graphs
        assert (graphs is not None) == (mode is not None)
        assert isinstance(graphs, FullDecodeGraphs) == (mode == "full")
        assert engine.get_server_info()["cuda_graphs"] == (mode or "off")
        params = {"temperature": 0, "max_new_tokens": NEW, "ignore_eos": True}
        outs = engine.generate(input_ids=ps, sampling_params=params)
        stats = engine.check_invariants()  # ring null row zero, pages as written
        assert stats.running == 0
        assert stats.tiers["cold"].used == stats.tiers["cold"].cached
        return [o["output_ids"] for o in outs], graphs.replayed_steps if graphs is not None else 0
    finally:
        engine.shutdown()


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3"])
@pytest.mark.parametrize("batch", [1, 3, 8, 11, 16])
def test_full_graph_greedy_equals_eager(tiny_path, kv_cache_dtype, batch):
    model = load_model(tiny_path, dtype="float32", device="cuda")
    ps = prompts(batch, seed=batch)
    eager, _ = greedy(model, kv_cache_dtype, None, ps)
    full, replayed = greedy(model, kv_cache_dtype, "full", ps)
    assert full == eager
    assert all(len(o) == NEW for o in full)
    if batch <= 12:
        assert replayed >= NEW - 1  # every decode step after the prefill's first token


@pytest.mark.parametrize("overlap", [True, False])
def test_full_graph_bfloat16_fp8_sinks_equals_piecewise(tiny_path, overlap):
    """BF16, fp8 history with sinks, padded batch (5 in bucket 8): the full graph and the piecewise
    graphs run the same kernels on the same plans."""
    model = load_model(tiny_path, dtype="bfloat16", device="cuda")
    ps = prompts(5, seed=11)
    piecewise, _ = greedy(model, "fp8_e4m3", "piecewise", ps, sinks=True, overlap=overlap)
    full, replayed = greedy(model, "fp8_e4m3", "full", ps, sinks=True, overlap=overlap)
    assert replayed >= NEW - 1
    assert full == piecewise


def held_bytes() -> int:
    """Memory torch holds on the device, after handing back what nothing uses: blocks cached but free
    (the capture's warm-up temporaries) and cuBLAS's workspaces (one per stream that ran a product;
    torch's own leak checks leave them out the same way; the plan does not count them either). The
    graphs captured here hold the freed workspace's address: they are never replayed."""
    torch.cuda.synchronize()
    gc.collect()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


@pytest.mark.parametrize("drift", [False, True])
def test_full_graph_memory_within_the_plans_estimate(tiny_path, drift):
    """The captured graphs stay within the plan's estimate; with the drift monitor's raised pool they
    hold the piecewise pieces too, in the same pool."""
    model = load_model(tiny_path, dtype="bfloat16", device="cuda")
    extra = DRIFT_ON if drift else {}
    engine = Engine(
        model=model,
        attention_backend="triton",
        kv_cache_dtype="fp8_e4m3",
        kv_plan="off",
        page_size=16,
        max_total_tokens=4096,
        max_running_requests=32,
        disable_cuda_graph=True,
        **extra,
    )
    try:
        assert (engine.cache.raised_pool is not None) == drift
        torch.cuda.synchronize()
        before = held_bytes()
        context = model.config.max_position_embeddings
        graphs = FullDecodeGraphs(model.net, 32, engine.cache, engine.runner.backend, context)
        assert graphs.with_pieces == drift
        graphs.capture()
        if drift:  # every bucket's pieces captured: first, one between each two layers, last
            assert all(len(graphs.graphs[bs]) == model.config.num_layers + 1 for bs in graphs.sizes)
        used = held_bytes() - before
        ring = engine.cache.ring.capacity
        estimate = graph_memory_bytes(model.config, 32, model.net.dtype)
        estimate += full_graph_memory_bytes(model.config, 32, context, 16, ring)
        assert 0 < used <= estimate, (used, estimate)
        engine.check_invariants()  # capture's runs wrote only the scratch row
    finally:
        engine.shutdown()


def raised_rounds(model, mode: str | None, rounds) -> tuple[list, list[tuple[int, int, int]]]:
    """Greedy outputs of ``rounds`` of prompts with the drift monitor's raised pool (never sampling;
    the first round at fallback level 0, the others at level 1), and per round the graphs' (whole,
    piecewise) steps."""
    engine = Engine(
        model=model,
        attention_backend="triton",
        kv_cache_dtype="fp8_e4m3",
        kv_plan="off",
        recent_window=16,
        page_size=16,
        max_total_tokens=4096,
        max_running_requests=16,
        cuda_graph_max_bs=12,
        cuda_graph_mode=mode or "piecewise",
        disable_cuda_graph=mode is None,
        **DRIFT_ON,
    )
    try:
        assert engine.cache.raised_pool is not None
        graphs = engine.runner.graphs
        assert isinstance(graphs, FullDecodeGraphs) == (mode == "full")
        outs, counts = rounds_at_levels(engine, graphs, rounds, NEW)
        stats = engine.check_invariants()
        assert stats.running == 0
        return outs, counts
    finally:
        engine.shutdown()


def test_full_graph_with_raised_pool_equals_eager(tiny_path):
    """Drift monitor on (a raised pool): whole-step graphs at fallback level 0, the captured pieces for
    steps over raised pages at level 1, the eager engine's tokens throughout."""
    model = load_model(tiny_path, dtype="float32", device="cuda")
    first, second = prompts(5, seed=21), prompts(5, seed=22)
    rounds = [first, second, first]
    eager, _ = raised_rounds(model, None, rounds)
    full, counts = raised_rounds(model, "full", rounds)
    assert full == eager
    # (whole, piecewise) decode steps: NEW - 1 a round, and the step overlap scheduling runs past its end
    steps = [NEW - 1 + past_end for _, _, past_end in counts]
    assert counts[0][:2] == (steps[0], 0)  # level 0: every decode step whole
    assert counts[1][:2] == (0, steps[1])  # level 1, new prompts: raised pages from the prefill on
    whole, pieces, _ = counts[2]  # level 1 over the first round's cached level-0 pages
    assert whole + pieces == steps[2] and whole > 0 and pieces > 0
