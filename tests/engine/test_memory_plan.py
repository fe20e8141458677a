"""The memory plan: the CUDA arithmetic with a fake device-memory reading (no GPU needed), byte counts
equal to what the cache allocates, and CPU sizing unchanged."""

from __future__ import annotations

import dataclasses
import logging

import pytest
import torch

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.cuda_graph import graph_memory_bytes
from kvstrata.engine.memory import (
    DEFAULT_CUDA_MEM_FRACTION_STATIC,
    DeviceMemory,
    ImagePoolNeed,
    image_pool_need,
    plan_memory,
    ring_bytes,
    sink_bytes,
    split_partial_bytes,
    split_target_programs,
    step_workspace_bytes,
    weight_bytes,
    with_raised_pool,
)
from kvstrata.engine.model import Transformer
from kvstrata.engine.options import EngineArgs
from kvstrata.radix import CacheConfig, StratifiedKVCache
from kvstrata.radix.kernels.attend import EXTEND_DEQUANT
from kvstrata.radix.pool import cold_page_bytes

GIB = 1 << 30
CUDA = torch.device("cuda")
CPU = torch.device("cpu")
LLAMA3_8B = ModelConfig(
    architecture="LlamaForCausalLM", num_layers=32, hidden_size=4096, intermediate_size=14336,
    q_heads=32, kv_heads=8, head_dim=128, vocab_size=128256,
)  # fmt: skip


def _cache(model: ModelConfig, codec: str = "fp8_e4m3", **kw: object) -> CacheConfig:
    base = dict(
        num_layers=model.num_layers,
        kv_heads=model.kv_heads,
        head_dim=model.head_dim,
        page_size=16,
        recent_window=128,
        layer_codecs=[codec] * model.num_layers,
        num_pages=0,
        max_running=256,
        sinks=True,
    )
    return CacheConfig(**{**base, **kw})


def test_cuda_plan_for_llama3_8b_on_an_h200_by_hand() -> None:
    weights = 8_030_261_248 * 2  # bfloat16
    total = 140 * GIB
    reading = DeviceMemory(total=total, free=total - weights - 512 * 2**20)  # 512 MiB CUDA context
    args = EngineArgs(mem_fraction_static=0.85, max_running_requests=256, chunked_prefill_size=512)
    plan = plan_memory(args, LLAMA3_8B, _cache(LLAMA3_8B), weights, torch.bfloat16, CUDA, reading)

    per_token_row = 2 * 32 * 8 * 128 * 2  # K and V, 32 layers, 8 heads x 128, bfloat16: 131,072 B
    assert plan.ring_bytes == (256 * (128 + 16) + 2) * per_token_row == 4_832_100_352  # + null, scratch rows
    assert plan.sink_bytes == (512 + 1) * 16 * per_token_row == 1_075_838_976  # 2 x 256 sink pages
    page = 65_808 * 16  # fp8_e4m3 cold bytes per token of this geometry (README, Capacity table)
    assert plan.cold_page_bytes == page
    tokens = 512 + 256
    hidden = tokens * (3 * 4096 + 48 * 128 + 3 * 14336) * 2
    logits = 256 * 128256 * 4 * 5
    keys = 64 * 16 + 16 + 144 + 512
    assert plan.workspace_bytes == hidden + logits + 2 * 32 * 512 * keys * 4 + 2 * keys * 8 * 128 * 2
    reserved = int(total * 0.15)
    assert plan.reserved_bytes == reserved
    left = reading.free - reserved - plan.ring_bytes - plan.sink_bytes - plan.workspace_bytes
    assert plan.cold_pages == left // page - 1
    # 133,726,461,952 free - 22,548,578,304 reserved - 4,831,969,280 ring - 1,075,838,976 sinks
    # - 980,287,488 workspace = 104,289,787,904 B = 99,047.4 pages, less the null page
    assert plan.cold_pages == 99_046 and plan.cold_tokens == 1_584_736
    # the whole static part stays within the fraction of the device
    static = weights + plan.cold_bytes + plan.ring_bytes + plan.sink_bytes + plan.workspace_bytes
    assert static <= 0.85 * total < static + page + 512 * 2**20 + 1
    table = plan.table()
    for row in ("weights", "cold pool", "1,584,736 tokens", "ring", "sinks", "workspace", "reserved"):
        assert row in table


SERVED_8B = dataclasses.replace(LLAMA3_8B, vocab_size=49_152)  # the benchmarks' model/ (SmolLM2 vocab)


def test_triton_workspace_holds_no_scores_and_fp4_holds_1024_requests_of_2k_on_an_h200() -> None:
    """The Triton kernels decode codes in registers: the workspace is the hidden states and the larger
    of the logits and (split-KV partials + an extend's dequantized history), not the reference's scores
    over an 8,192-token chunk (18.6 GiB here). With that, fp4 history (256-token window, sinks) for
    1,024 running requests of 1,536 + 512 tokens fits at --mem-fraction-static 0.9 on an H200 (the
    free-memory reading of a served run's plan)."""
    args = EngineArgs(kv_cache_dtype="fp4_e2m1", max_running_requests=1024, chunked_prefill_size=8192,
                      mem_fraction_static=0.9)  # fmt: skip
    cache = _cache(SERVED_8B, "fp4_e2m1", max_running=1024, recent_window=args.recent_window)
    # a served run's reading: 139.801 GiB total, 125.444 GiB free after the weights
    reading = DeviceMemory(total=150_110_011_392, free=134_693_568_512)
    plan = _served_plan(args, cache, reading)
    tokens = 8192 + 1024
    hidden = tokens * (3 * 4096 + 48 * 128 + 3 * 14336) * 2
    logits = 1024 * 49_152 * 4 * 5
    partials = (1024 + split_target_programs() // 8) * 32 * 129 * 4  # one pass: decode splits only
    assert split_partial_bytes(SERVED_8B, 1024, 8192) == partials < 2**26
    # partials and the extend's dequantized history (inside attention) or the logits (after it)
    assert plan.workspace_bytes == hidden + max(logits, partials + EXTEND_DEQUANT["dequant_bytes"])
    assert plan.workspace_bytes == hidden + logits  # 1 GB of logits at 1,024 running
    reference = step_workspace_bytes(SERVED_8B, cache, 8192, torch.bfloat16)
    assert reference - plan.workspace_bytes > 18 * GIB
    assert plan.ring_bytes == (1024 * (256 + 16) + 2) * 131_072  # 34 GiB of BF16 windows
    assert plan.sink_bytes == (2048 + 1) * 16 * 131_072
    assert plan.cold_page_bytes == 36_384 * 16  # fp4_e2m1 cold bytes per token (README, Capacity)
    # every request's 2,047 stored tokens: 127 full pages in the pool (178 pages to spare at a
    # 4,096-program split target), the last partial page in its ring
    assert plan.cold_tokens >= 1024 * 127 * 16 + 128 * 16
    default = _served_plan(dataclasses.replace(args, mem_fraction_static=None), cache, reading)
    assert 0.899 < default.cold_tokens / plan.cold_tokens < 0.902  # the default 0.85: 90% of them


def test_partials_of_several_passes_hold_a_chunk_of_extend_rows_twice() -> None:
    """With an image pool or a raised pool a layer runs 2 or 3 kernel passes: each writes partials for
    all of its rows, extends included (a prefill chunk's rows, unsplit), and the merge concatenates
    them (one more copy). One pass writes partials only when a decode splits."""
    row = 32 * 129 * 4  # float32 output row and log-sum-exp of every query head
    decode_rows = 1024 + -(-split_target_programs() // 8)
    assert split_partial_bytes(SERVED_8B, 1024, 8192, 1) == decode_rows * row
    assert split_partial_bytes(SERVED_8B, 1024, 8192, 2) == 2 * 2 * 8192 * row
    assert split_partial_bytes(SERVED_8B, 1024, 8192, 3) == 2 * 3 * 8192 * row
    wide = 4096 + -(-split_target_programs() // 8)  # more decode rows than a chunk's
    assert split_partial_bytes(SERVED_8B, 4096, 512, 3) == 2 * 3 * wide * row
    cache = _cache(SERVED_8B, max_running=1024)
    args = EngineArgs(max_running_requests=1024, chunked_prefill_size=8192)
    one = step_workspace_bytes(SERVED_8B, cache, 8192, torch.bfloat16, True)
    three = step_workspace_bytes(SERVED_8B, cache, 8192, torch.bfloat16, True, cold_passes=3)
    hidden = (8192 + 1024) * (3 * 4096 + 48 * 128 + 3 * 14336) * 2
    logits, dequant = 1024 * 49_152 * 4 * 5, EXTEND_DEQUANT["dequant_bytes"]
    assert one == hidden + max(logits, decode_rows * row + dequant) == hidden + logits
    assert three == hidden + 6 * 8192 * row + dequant > one
    reading = DeviceMemory(140 * GIB, 120 * GIB)
    plan = plan_memory(args, SERVED_8B, cache, 16 * GIB, torch.bfloat16, CUDA, reading,
                       attention_kernels=True, cold_passes=3)  # fmt: skip
    assert plan.workspace_bytes == three


def _served_plan(args: EngineArgs, cache: CacheConfig, reading: DeviceMemory):
    """The plan `kvstrata serve` makes for the served 8B model: Triton attention, decode graphs up to
    the running cap."""
    graphs = graph_memory_bytes(SERVED_8B, args.max_running_requests, torch.bfloat16)
    return plan_memory(args, SERVED_8B, cache, 14_764_482_816, torch.bfloat16, CUDA, reading, graphs,
                       attention_kernels=True)  # fmt: skip


def _on_cuda(args: EngineArgs, cache: CacheConfig, free_gib: int, graph_bytes: int = 0):
    reading = DeviceMemory(140 * GIB, free_gib * GIB)
    return plan_memory(args, LLAMA3_8B, cache, 16 * GIB, torch.bfloat16, CUDA, reading, graph_bytes)


def test_cuda_default_fraction_and_other_processes_memory() -> None:
    cache = _cache(LLAMA3_8B, "fp4_e2m1", max_running=64)
    alone = _on_cuda(EngineArgs(), cache, 123)
    assert alone.mem_fraction_static == DEFAULT_CUDA_MEM_FRACTION_STATIC
    page = alone.cold_page_bytes
    # 10 GiB held by another process come out of the pool, to the page; so does graph memory
    shared = _on_cuda(EngineArgs(), cache, 113)
    assert (alone.cold_pages - shared.cold_pages) * page == pytest.approx(10 * GIB, abs=page)
    graphs = _on_cuda(EngineArgs(), cache, 123, graph_bytes=GIB)
    assert (alone.cold_pages - graphs.cold_pages) * page == pytest.approx(GIB, abs=page)


def test_max_total_tokens_wins_and_a_full_device_is_refused() -> None:
    cache = _cache(LLAMA3_8B)
    exact = _on_cuda(EngineArgs(max_total_tokens=1000), cache, 123)
    assert exact.cold_pages == 63 and exact.source == "max_total_tokens"  # ceil(1000 / 16)
    with pytest.raises(ValueError, match="raise --mem-fraction-static"):
        _on_cuda(EngineArgs(mem_fraction_static=0.1), cache, 123)  # 14 GiB < 16 GiB weights


def test_cpu_sizing_is_unchanged() -> None:
    model = ModelConfig("LlamaForCausalLM", 2, 64, 96, 4, 2, 16, 300)
    cache = _cache(model, max_running=4)
    plan = plan_memory(EngineArgs(), model, cache, 10, torch.float32, CPU)
    assert plan.cold_pages == 16384 // 16 and plan.source == "cpu default" and plan.total_bytes is None
    plan = plan_memory(EngineArgs(max_total_tokens=100), model, cache, 10, torch.float32, CPU)
    assert plan.cold_pages == 7


@pytest.mark.parametrize("codec,sinks", [("int4", True), ("fp8_e4m3", False), ("bf16", True)])
def test_planned_bytes_are_what_the_cache_allocates(codec: str, sinks: bool) -> None:
    model = ModelConfig("LlamaForCausalLM", 3, 64, 96, 4, 2, 16, 300)
    cfg = _cache(model, codec, max_running=5, recent_window=32, sinks=sinks, max_recent_window=64)
    plan = plan_memory(EngineArgs(max_total_tokens=480), model, cfg, 0, torch.float32, CPU)
    cache = StratifiedKVCache(CacheConfig(**{**cfg.__dict__, "num_pages": plan.cold_pages}))
    assert plan.ring_bytes == ring_bytes(cfg) == cache.ring.k.nbytes + cache.ring.v.nbytes
    pool = sum(t.nbytes for bufs in (*cache.pool.k, *cache.pool.v) for t in bufs.values())
    assert plan.cold_bytes == pool
    got_sinks = cache.sinks.k.nbytes + cache.sinks.v.nbytes if cache.sinks is not None else 0
    assert plan.sink_bytes == sink_bytes(cfg) == got_sinks


def test_weight_bytes_count_tied_storage_once() -> None:
    tied = ModelConfig("LlamaForCausalLM", 2, 64, 96, 4, 2, 16, 300, tie_word_embeddings=True)
    untied = ModelConfig("LlamaForCausalLM", 2, 64, 96, 4, 2, 16, 300)
    a, b = Transformer(tied), Transformer(untied)
    params = sum(p.numel() for p in b.parameters())
    assert weight_bytes(b) == params * 4 + b.inv_freq.nbytes
    assert weight_bytes(a) == (params - 300 * 64) * 4 + a.inv_freq.nbytes
    assert step_workspace_bytes(untied, _cache(untied, max_running=2), 8, torch.float32) > 0


@pytest.mark.parametrize("backend,drift", [("torch", 0.0), ("triton", 0.0), ("triton", 0.5)])
def test_engine_plans_the_workspace_of_its_attention_backend(
    default_model, backend, drift, monkeypatch
) -> None:
    """The workspace of the engine's backend; with the drift monitor's raised pool the kernels run two
    passes a layer (text pool, raised pool), whose partials the plan holds back."""
    from kvstrata import Engine

    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the triton backend is only built here, never run
    engine = Engine(
        model=default_model, max_total_tokens=2000, max_running_requests=2, attention_backend=backend,
        kv_cache_dtype="int4", drift_sample_rate=drift,
    )  # fmt: skip
    try:
        core = engine.core
        chunk, kernels = core.args.chunked_prefill_size, backend == "triton"
        passes = 1 + (core.cache_config.raised_pages > 0)
        assert passes == (2 if drift else 1)
        want = step_workspace_bytes(
            default_model.config, core.cache_config, chunk, core.dtype, kernels, passes
        )
        assert core.memory_plan.workspace_bytes == want
        if drift:
            one = step_workspace_bytes(default_model.config, core.cache_config, chunk, core.dtype, kernels)
            assert want > one
    finally:
        engine.shutdown()


def test_engine_logs_the_plan_and_sizes_its_pool_from_it(default_model, caplog) -> None:
    from kvstrata import Engine

    with caplog.at_level(logging.INFO, logger="kvstrata.engine"):
        engine = Engine(model=default_model, max_total_tokens=2000, max_running_requests=2)
    try:
        plan = engine.core.memory_plan
        assert plan.cold_pages == 125 and engine.cache_config.num_pages == 125
        assert engine.capacity_tokens == 2000 and plan.weight_bytes == weight_bytes(default_model.net)
        assert "memory plan on cpu" in caplog.text and "2,000 tokens (125 pages)" in caplog.text
    finally:
        engine.shutdown()


def _image_need(cache: CacheConfig, budget: int | None = None, codec: str = "bf16") -> ImagePoolNeed:
    """Image pages in ``codec`` for 576-token images (LLaVA-1.5), ``cache.max_running`` spans."""
    image_page = cold_page_bytes([codec] * cache.num_layers, cache.page_size, cache.kv_heads, cache.head_dim)
    args = EngineArgs(max_running_requests=cache.max_running, page_size=cache.page_size)
    return image_pool_need(args, dataclasses.replace(cache, pin_budget_bytes=budget), image_page, 576)


def _static_free(plan) -> int:
    """What the fraction leaves for the pools: free after weights - reserved - ring - sinks - workspace."""
    return plan.free_bytes - plan.reserved_bytes - plan.ring_bytes - plan.sink_bytes - plan.workspace_bytes


def test_cuda_image_pool_comes_out_of_the_cold_pool() -> None:
    """Default pin budget (a quarter of the cold pool's bytes): the largest cold pool whose image pool
    still fits; the cold pool shrinks by the image pool's bytes and the table shows both."""
    cache = _cache(LLAMA3_8B, max_running=64)
    need = _image_need(cache)
    assert need.page_bytes == 2 * 32 * 16 * 8 * 128 * 2 == 2_097_152  # bf16 image pages
    assert need.span_pages == 64 * (576 // 16 + 2) == 2_432
    alone = _on_cuda(EngineArgs(), cache, 123)
    plan = plan_memory(EngineArgs(), LLAMA3_8B, cache, 16 * GIB, torch.bfloat16, CUDA,
                       DeviceMemory(140 * GIB, 123 * GIB), image=need)  # fmt: skip
    tb, ib, free = plan.cold_page_bytes, need.page_bytes, _static_free(plan)
    assert tb == 1_052_928 and free == 107_578_720_256 and alone.cold_pages == free // tb - 1 == 102_170
    # by hand: n cold pages and n * tb / 4 / ib + 2,432 image pages (null pages included) fill the
    # 107.6 GB: n ~ (free - tb - 2,433 ib) / (1.25 tb) = 77,859.4; the floors let one more page in
    n = plan.cold_pages
    assert n == 77_860 and plan.image_pages == n * tb // 4 // ib + 2_432 == 12_204
    assert (n + 1) * tb + (plan.image_pages + 1) * ib <= free < (n + 2) * tb + need.bytes(n + 1, tb)
    assert plan.image_bytes == (plan.image_pages + 1) * ib == need.bytes(n, tb)
    table = plan.table()
    assert "image pool" in table and "195,264 tokens (12,204 pages)" in table


def test_explicit_pin_budget_and_max_total_tokens() -> None:
    cache = _cache(LLAMA3_8B, max_running=8)
    need = _image_need(cache, budget=10 * GIB)
    plan = plan_memory(EngineArgs(), LLAMA3_8B, cache, 16 * GIB, torch.bfloat16, CUDA,
                       DeviceMemory(140 * GIB, 123 * GIB), image=need)  # fmt: skip
    assert plan.image_pages == 10 * GIB // need.page_bytes + 8 * 38 == 5_424
    free = _static_free(plan)
    assert plan.cold_pages == (free - plan.image_bytes) // plan.cold_page_bytes - 1 == 92_734
    # max_total_tokens (and CPU) keep the cold pool's size; the image pool comes on top
    exact = plan_memory(EngineArgs(max_total_tokens=1000), LLAMA3_8B, cache, 0, torch.bfloat16, CUDA,
                        image=_image_need(cache))  # fmt: skip
    assert (
        exact.cold_pages == 63 and exact.image_pages == 63 * exact.cold_page_bytes // 4 // 2**21 + 304 == 311
    )


@pytest.mark.parametrize("codec,image", [("int4", "bf16"), ("fp8_e4m3", "int4")])
def test_planned_image_bytes_are_what_the_cache_allocates(codec: str, image: str) -> None:
    model = ModelConfig("LlamaForCausalLM", 3, 64, 96, 4, 2, 16, 300)
    cfg = _cache(model, codec, max_running=5, recent_window=32)
    need = _image_need(cfg, codec=image)
    plan = plan_memory(EngineArgs(max_total_tokens=480), model, cfg, 0, torch.float32, CPU, image=need)
    cache = StratifiedKVCache(
        CacheConfig(
            **{
                **cfg.__dict__,
                "num_pages": plan.cold_pages,
                "image_codec": image,
                "image_pages": plan.image_pages,
                "image_token_from": 300,
            }
        )  # fmt: skip
    )
    assert cache.image_pool is not None and cache.image_pool.allocator.total == plan.image_pages
    pool = sum(t.nbytes for bufs in (*cache.image_pool.k, *cache.image_pool.v) for t in bufs.values())
    assert plan.image_bytes == pool and plan.image_page_bytes == cache.image_pool.page_bytes


def test_raised_pool_takes_its_share_of_the_cold_bytes_and_allocates_what_it_plans() -> None:
    model = ModelConfig("LlamaForCausalLM", 3, 64, 96, 4, 2, 16, 300)
    cfg = _cache(model, "int4", max_running=5, recent_window=32)
    plan = plan_memory(EngineArgs(max_total_tokens=1600), model, cfg, 0, torch.float32, CPU)
    raised = ["int8_asym/int8"] * 3
    raised_bytes = cold_page_bytes(raised, 16, 2, 16)
    split = with_raised_pool(plan, raised_bytes, 0.25)
    assert split.raised_pages == int(0.25 * plan.cold_pages * plan.cold_page_bytes) // raised_bytes > 0
    assert split.cold_bytes + split.raised_bytes <= plan.cold_bytes  # never more than the cold pool alone
    assert plan.cold_bytes - (split.cold_bytes + split.raised_bytes) < plan.cold_page_bytes
    assert "raised pool" in split.table()
    cache = StratifiedKVCache(
        CacheConfig(
            **{
                **cfg.__dict__,
                "num_pages": split.cold_pages,
                "raised_codecs": raised,
                "raised_pages": split.raised_pages,
            }
        )
    )
    assert cache.raised_pool is not None and cache.raised_pool.allocator.total == split.raised_pages
    pool = sum(t.nbytes for bufs in (*cache.raised_pool.k, *cache.raised_pool.v) for t in bufs.values())
    assert split.raised_bytes == pool and split.raised_page_bytes == cache.raised_pool.page_bytes
    assert with_raised_pool(plan, plan.cold_bytes, 0.25) == plan  # too small for one raised page: unchanged
