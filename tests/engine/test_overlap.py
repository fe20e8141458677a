"""Overlap scheduling (forced on here on the CPU) gives the same tokens as planning after each read-back.

Each scenario runs on two engines of the same configuration, one with ``core.overlap`` off and one
with it on, and compares outputs token for token (greedy): stop tokens and strings that end requests
mid-batch while their next step is already launched, different lengths, preemption under a small
pool, prefix-cache hits, fp8 history with a window and sinks, aborts mid-stream. After each: pages in
use == pages held by the tree, no sequence running, ``check_invariants()`` passes.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import torch
from prompt_texts import PROMPT_TEXTS

from kvstrata.engine.drift import DriftSample
from kvstrata.engine.engine import Engine

LENGTHS = [3, 40, 17, 1, 29, 24]


@pytest.fixture(scope="module")
def prompts(default_model):
    return [default_model.tokenizer.encode(t) for t in PROMPT_TEXTS]


def make(model: Any, overlap: bool, **kwargs: Any) -> Engine:
    opts: dict[str, Any] = dict(
        kv_cache_dtype="auto",
        recent_window=16,
        page_size=16,
        max_total_tokens=4096,
        max_running_requests=8,
        chunked_prefill_size=64,
    )
    engine = Engine(model=model, **{**opts, **kwargs})
    engine.core.overlap = overlap  # read by the engine thread at each step; no request is running yet
    return engine


def assert_clean(engine: Engine) -> int:
    """Invariants after a scenario; returns the pages the prefix tree holds."""
    stats = engine.check_invariants()
    cold = stats.tiers["cold"]
    assert cold.used == cold.cached
    assert stats.running == 0
    assert engine.get_stats().num_running_reqs == 0
    return cold.cached


def outputs(engine: Engine, prompts: list[list[int]], params: list[dict[str, Any]]) -> list[tuple]:
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return [(o["output_ids"], o["text"], o["meta_info"]["finish_reason"]) for o in outs]


def both(model: Any, run: Any, **kwargs: Any) -> tuple[Any, Any, int]:
    """``run(engine)`` with overlap off, then on; returns both results and the deferred step count.
    Both leave the same pages in the prefix tree: a request that finished while its next step was
    already launched leaves no page of that step behind."""
    results, tree_pages = [], []
    deferred = 0
    for overlap in (False, True):
        engine = make(model, overlap, **kwargs)
        try:
            results.append(run(engine))
            tree_pages.append(assert_clean(engine))
            deferred = engine.core.deferred_steps
        finally:
            engine.shutdown()
    assert tree_pages[0] == tree_pages[1]
    return results[0], results[1], deferred


def mixed_params(reference: list[list[int]], tokenizer: Any) -> list[dict[str, Any]]:
    """Different lengths; request 1 stops on a token, request 4 on a string, both mid-batch."""
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
    params[1]["stop_token_ids"] = [reference[1][9]]
    params[4]["stop"] = [tokenizer.decode(reference[4][:14])[-5:]]
    return params


@pytest.fixture(scope="module")
def reference(default_model, prompts):
    engine = make(default_model, False)
    try:
        params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in LENGTHS]
        return [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
    finally:
        engine.shutdown()


def test_stops_and_lengths_mid_batch(default_model, prompts, reference):
    params = mixed_params(reference, default_model.tokenizer)
    off, on, deferred = both(default_model, lambda e: outputs(e, prompts, params))
    assert on == off
    assert off[1][2] == {"type": "stop", "matched": reference[1][9]}
    assert off[4][2]["type"] == "stop" and len(off[4][0]) < LENGTHS[4]
    assert deferred > 0


def test_prefix_cache_hits(default_model, prompts, reference):
    params = mixed_params(reference, default_model.tokenizer)

    def twice(engine: Engine) -> tuple:
        first = outputs(engine, prompts, params)
        again = engine.generate(input_ids=prompts, sampling_params=params)
        cached = [o["meta_info"]["cached_tokens"] for o in again]
        return first, [(o["output_ids"], o["meta_info"]["finish_reason"]) for o in again], cached

    off, on, deferred = both(default_model, twice)
    assert on == off
    assert sum(off[2]) > 0  # the second round read prompt pages from the tree
    assert deferred > 0


def test_preemption_under_a_small_pool(default_model, prompts, reference):
    def squeezed(engine: Engine) -> tuple:
        engine.core.scheduler.future_tokens = lambda req: 0.0  # admit all: the pool forces preemptions
        params = [{"temperature": 0, "max_new_tokens": 40, "ignore_eos": True}] * len(prompts)
        before = engine.get_stats().preemptions_total
        outs = outputs(engine, prompts, params)
        return outs, engine.get_stats().preemptions_total - before

    off, on, deferred = both(default_model, squeezed, max_total_tokens=160, max_running_requests=4)
    assert on[0] == off[0]
    assert off[1] > 0 and on[1] > 0
    assert deferred > 0


def test_fp8_history_with_window_and_sinks(default_model, prompts, reference):
    long_prompts = [p * 4 for p in prompts[:4]]  # past the window: history is read from fp8 pages
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (30, 9, 21, 2)]
    params[0]["stop_token_ids"] = [7]  # may or may not occur: both runs must agree either way
    off, on, deferred = both(
        default_model,
        lambda e: (outputs(e, long_prompts, params), e.get_server_info()["sinks"]),
        kv_cache_dtype="fp8_e4m3",
        recent_window=32,
    )
    assert on == off
    assert off[1]  # sinks on
    assert deferred > 0


def test_streaming_chunks_and_abort_mid_stream(default_model, prompts, reference):
    def streams(engine: Engine) -> tuple:
        async def main() -> tuple:
            async def collect(i: int) -> list[dict[str, Any]]:
                params = {"temperature": 0, "max_new_tokens": LENGTHS[i], "ignore_eos": True}
                return [
                    c
                    async for c in engine.async_generate(
                        input_ids=prompts[i], sampling_params=params, stream=True
                    )
                ]

            async def aborted() -> list[dict[str, Any]]:
                params = {"temperature": 0, "max_new_tokens": 500, "ignore_eos": True}
                chunks = []
                async for c in engine.async_generate(
                    input_ids=prompts[0], sampling_params=params, stream=True, rid="gone"
                ):
                    chunks.append(c)
                    if len(chunks) == 3:
                        engine.abort("gone")
                return chunks

            return await asyncio.gather(*(collect(i) for i in (1, 2, 4)), aborted())

        *whole, cut = asyncio.run(main())
        ids = [[t for c in chunks for t in c["output_ids"]] for chunks in whole]
        counts = [len(chunks) for chunks in whole]
        finals = [chunks[-1]["finished"] for chunks in whole]
        cut_ids = [t for c in cut for t in c["output_ids"]]
        return ids, counts, finals, cut_ids, cut[-1]["meta_info"]["finish_reason"]["type"]

    off, on, deferred = both(default_model, streams)
    assert on[:3] == off[:3]
    assert on[0] == [reference[i] for i in (1, 2, 4)]
    for cut_ids, kind in (off[3:], on[3:]):
        assert kind == "abort"
        assert 3 <= len(cut_ids) < 500
    assert deferred > 0


def test_finish_where_the_dropped_step_would_complete_a_page(default_model, prompts):
    # prompt + max_new_tokens = a multiple of the page size: the step launched on the last token
    # would complete a page; it is dropped, so the tree holds the same pages as without overlap.
    cut = [p[:10] for p in prompts[:4]]
    params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in (6, 22, 38, 13)]
    off, on, deferred = both(default_model, lambda e: outputs(e, cut, params))
    assert on == off
    assert deferred > 0


def test_graph_buffers_read_the_ids_on_the_device(default_model, prompts, reference):
    # The CUDA-graph path without graphs (pieces on the static buffers, buckets 1, 2, 4): the ids of
    # pending requests are copied into the graphs' id buffer on the device.
    from kvstrata.engine.cuda_graph import DecodeGraphs

    params = mixed_params(reference, default_model.tokenizer)

    def on_buffers(engine: Engine) -> tuple:
        engine.runner.graphs = DecodeGraphs(default_model.net, 4)
        engine.runner.graphs.use_pieces()
        return outputs(engine, prompts[:4], params[:4]), engine.runner.graphs.replayed_steps

    off, on, deferred = both(default_model, on_buffers)
    assert on[0] == off[0]
    assert off[1] > 0 and on[1] > 0
    assert deferred > 0


def test_a_failed_plan_takes_the_token_in_flight_first(default_model, monkeypatch):
    from kvstrata.radix import cache as cache_module

    real = cache_module.build_step
    calls = {"n": 0}

    def failing(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        if calls["n"] == 2:  # the decode step planned while the prefill's token is in flight
            raise torch.OutOfMemoryError("injected: out of memory while planning")
        return real(*args, **kwargs)

    engine = make(default_model, True)
    try:
        monkeypatch.setattr(cache_module, "build_step", failing)
        params = {"max_new_tokens": 8, "ignore_eos": True}
        out = engine.generate(input_ids=list(range(300, 350)), sampling_params=params)
        monkeypatch.setattr(cache_module, "build_step", real)
        assert "out of memory while planning" in out["meta_info"]["finish_reason"]["message"]
        assert out["meta_info"]["completion_tokens"] == 1  # the prefill's token, then the failed step
        assert engine.core.deferred_steps == 1
        assert_clean(engine)
    finally:
        engine.shutdown()


@pytest.mark.parametrize("recorded", [4, 64])
def test_drift_sampled_requests_defer_once_recorded(default_model, prompts, recorded):
    """The drift monitor reads a sampled request's log-softmax rows for its first ``drift_max_tokens``
    steps only: after those its steps keep their ids on the device like any other's (with 4 recorded
    of 24 tokens, most steps defer; with 64, none does). Same tokens as without overlap, and every
    request's re-scored sample holds exactly the recorded steps."""
    params = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}

    def run(engine: Engine) -> tuple[list, list[int]]:
        samples: list[DriftSample] = []
        engine.subscribe(lambda e: samples.append(e) if isinstance(e, DriftSample) else None)
        got = outputs(engine, prompts[:3], [params] * 3)
        assert engine.wait_drift_idle(timeout=120)
        return got, sorted(s.tokens for s in samples)

    drift = dict(drift_sample_rate=1.0, drift_threshold=1e9, drift_max_tokens=recorded, seed=0)
    (off, off_tokens), (on, on_tokens), deferred = both(default_model, run, **drift)
    assert on == off
    assert off_tokens == on_tokens == [min(recorded, 24)] * 3
    assert (deferred > 0) is (recorded < 24)
