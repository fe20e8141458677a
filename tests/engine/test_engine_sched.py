"""Scheduler under pressure: preemption never corrupts, abort and exhaustion free everything.

After every scenario, once all requests have ended: pages in use == pages held by the tree, no
sequence is running, and ``check_invariants()`` passes.
"""

from __future__ import annotations

import threading

import pytest
from prompt_texts import PROMPT_TEXTS

from kvstrata.engine.engine import Engine
from kvstrata.engine.stats import RequestFinished

N_NEW = 40


@pytest.fixture(scope="module")
def prompts(default_model):
    return [default_model.tokenizer.encode(t) for t in PROMPT_TEXTS]


def make(model, total_tokens: int, running: int) -> Engine:
    return Engine(
        model=model,
        kv_cache_dtype="auto",
        recent_window=16,
        page_size=16,
        max_total_tokens=total_tokens,
        max_running_requests=running,
        chunked_prefill_size=64,
    )


@pytest.fixture(scope="module")
def reference(default_model, prompts):
    eng = make(default_model, 4096, 8)
    try:
        params = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
        return [o["output_ids"] for o in eng.generate(input_ids=prompts, sampling_params=params)]
    finally:
        eng.shutdown()


@pytest.fixture(scope="module")
def tiny(default_model):
    eng = make(default_model, 160, 4)  # 10 pages; 4 running requests need up to 20
    yield eng
    eng.shutdown()


def assert_clean(engine: Engine) -> None:
    stats = engine.check_invariants()
    cold = stats.tiers["cold"]
    assert cold.used == cold.cached
    assert stats.running == 0
    snap = engine.get_stats()
    assert snap.num_running_reqs == 0 and snap.num_queue_reqs == 0


def test_preemption_recomputes_exactly(tiny, prompts, reference, monkeypatch):
    # Without the admission reserve (each request expected to write nothing more), all six are
    # admitted as slots allow and the pool forces preemptions, which must not change any output.
    monkeypatch.setattr(tiny.core.scheduler, "future_tokens", lambda req: 0.0)
    events: list[RequestFinished] = []
    unsubscribe = tiny.subscribe(lambda e: events.append(e) if isinstance(e, RequestFinished) else None)
    before = tiny.get_stats().preemptions_total
    params = {"temperature": 0, "max_new_tokens": N_NEW, "ignore_eos": True}
    outs = tiny.generate(input_ids=prompts, sampling_params=params)
    unsubscribe()
    assert [o["output_ids"] for o in outs] == reference
    assert tiny.get_stats().preemptions_total > before
    assert sum(e.preemptions for e in events) > 0
    assert all(e.status == "success" and e.ttft is not None and e.ttft > 0 for e in events)
    assert all(len(e.inter_token_latencies) == N_NEW - 1 for e in events)
    assert_clean(tiny)


def test_abort_queued_and_running(tiny, prompts):
    params = {"temperature": 0, "max_new_tokens": 400, "ignore_eos": True}
    streams = [
        tiny.generate(input_ids=p, sampling_params=params, stream=True, rid=f"ab-{i}")
        for i, p in enumerate(prompts)
    ]
    finals: dict[int, dict] = {}
    started = threading.Event()

    def consume(i: int) -> None:
        for chunk in streams[i]:
            started.set()
            if chunk["finished"]:
                finals[i] = chunk

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    assert started.wait(timeout=120)  # some run, the others (6 requests, 4 slots) are queued
    for i in range(len(prompts)):
        tiny.abort(f"ab-{i}")
    for t in threads:
        t.join(timeout=120)
    assert sorted(finals) == list(range(len(prompts)))
    assert all(f["meta_info"]["finish_reason"]["type"] == "abort" for f in finals.values())
    assert all(f["meta_info"]["completion_tokens"] < 400 for f in finals.values())
    assert_clean(tiny)


def test_closing_a_stream_aborts(tiny, prompts):
    it = tiny.generate(input_ids=prompts[1], sampling_params={"max_new_tokens": 300}, stream=True)
    next(it)
    it.close()  # the consumer went away
    tiny.generate(input_ids=prompts[2], sampling_params={"max_new_tokens": 1})  # let the engine run a step
    assert_clean(tiny)


def test_exhaustion(tiny, prompts, default_model):
    with pytest.raises(ValueError, match="KV pool 160 tokens"):
        tiny.generate(input_ids=list(range(100, 300)), sampling_params={})
    # alone and still growing past the pool: ends with "length", pool full; nothing leaks
    long_prompt = (prompts[2] * 8)[:120]
    out = tiny.generate(input_ids=long_prompt, sampling_params={"max_new_tokens": 200, "ignore_eos": True})
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "length" and reason.get("pool") == "full"
    # 10 cold pages + 15 ring tokens of the incomplete 11th page have K/V; one more token is sampled
    assert out["meta_info"]["prompt_tokens"] == 120
    assert 120 + out["meta_info"]["completion_tokens"] == 160 + 16
    out0 = tiny.generate(input_ids=prompts[0], sampling_params={"max_new_tokens": 0})
    assert out0["output_ids"] == [] and out0["meta_info"]["finish_reason"]["type"] == "length"
    assert_clean(tiny)


def test_mixed_then_flush(tiny, prompts):
    params = [
        {"temperature": 0.8, "max_new_tokens": 30, "seed": i, "n": 1 + i % 2, "ignore_eos": True}
        for i in range(len(prompts))
    ]
    streams = [
        tiny.generate(input_ids=p, sampling_params=sp, stream=True, rid=f"mx-{i}")
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    done = []

    def consume(i: int) -> None:
        for chunk in streams[i]:
            if chunk["finished"]:
                done.append(chunk["meta_info"]["finish_reason"]["type"])

    threads = [threading.Thread(target=consume, args=(i,)) for i in range(len(streams))]
    for t in threads:
        t.start()
    tiny.abort("mx-1")
    tiny.abort("mx-4")
    for t in threads:
        t.join(timeout=300)
    assert len(done) == sum(sp["n"] for sp in params)
    assert done.count("abort") >= 1
    assert_clean(tiny)
    assert tiny.flush_cache()
    stats = tiny.cache_stats()
    assert stats.tiers["cold"].used == 0 and stats.tiers["cold"].free == stats.tiers["cold"].total


def test_failed_step_ends_its_requests_and_engine_survives(tiny, prompts):
    net = tiny.runner.net
    calls = {"n": 0}

    def flaky(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("boom")
        return net(*args, **kwargs)

    tiny.runner.net = flaky
    try:
        out = tiny.generate(input_ids=prompts[3], sampling_params={"max_new_tokens": 10, "ignore_eos": True})
    finally:
        tiny.runner.net = net
    reason = out["meta_info"]["finish_reason"]
    assert reason["type"] == "abort" and "boom" in reason["message"]
    assert tiny.get_stats().requests_finished_total["error"] == 1
    assert_clean(tiny)
    ok = tiny.generate(input_ids=prompts[3], sampling_params={"max_new_tokens": 3})
    assert ok["meta_info"]["completion_tokens"] == 3


def test_nothing_can_be_posted_after_shutdown(default_model):
    """Once the engine thread has drained its inbox for the last time, posting raises at once
    instead of leaving the caller waiting for an answer that never comes."""
    eng = make(default_model, total_tokens=256, running=2)
    eng.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        eng.core.post("add", [])
    with pytest.raises(RuntimeError, match="shut down"):
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 1})
    eng.abort("no-such-request")  # nothing left to abort: a no-op, not an error
