"""Streamed chunks reach asyncio callers through one loop wake-up per engine iteration (`LoopMailbox`),
in order and completely, whether the engine flushes after each step (CPU default) or when the next
step's sampler is about to wait for the device (CUDA default, forced here on the CPU), with overlap
scheduling (CUDA default, forced here too) or without."""

from __future__ import annotations

import asyncio
import gc
import threading
import weakref

import pytest

from kvstrata.engine.delivery import LoopMailbox
from kvstrata.engine.engine import Engine

PROMPTS = ["The lighthouse keeper opened the bottle and read", "def add(a, b):\n", "Paris is", "Once"]


def _counting(loop: asyncio.AbstractEventLoop) -> list[int]:
    """Count the loop's call_soon_threadsafe calls (the self-pipe writes a mailbox saves)."""
    calls = [0]
    original = loop.call_soon_threadsafe

    def counted(*args, **kwargs):
        calls[0] += 1
        return original(*args, **kwargs)

    loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
    return calls


def test_mailbox_one_wakeup_per_flush_in_order():
    async def main():
        loop = asyncio.get_running_loop()
        calls = _counting(loop)
        box = LoopMailbox(loop)
        queues = [asyncio.Queue() for _ in range(3)]
        sinks = [box.sink(q) for q in queues]

        def engine_thread():
            for i in range(100):
                sinks[i % 3](i)
            box.flush()
            box.flush()  # armed: the pending drain takes everything, no second wake-up

        t = threading.Thread(target=engine_thread)
        t.start()
        t.join()
        got = [[await asyncio.wait_for(q.get(), 5) for _ in range(len(range(k, 100, 3)))] for k, q in
               enumerate(queues)]  # fmt: skip
        box.flush()  # nothing new: no wake-up
        return calls[0], got

    calls, got = asyncio.run(main())
    assert calls == 1
    assert got == [list(range(k, 100, 3)) for k in range(3)]


def test_mailbox_on_a_closed_loop_drops_quietly():
    loop = asyncio.new_event_loop()
    box = LoopMailbox(loop)
    box.sink(asyncio.Queue())("chunk")
    loop.close()
    box.flush()  # no exception: nobody listens
    box.sink(asyncio.Queue())("again")
    box.flush()


def test_a_mailbox_does_not_keep_its_loop_alive():
    """`Engine` keeps one mailbox per loop in a WeakKeyDictionary keyed by the loop: a mailbox that
    held its loop strongly would keep every finished loop (each ``asyncio.run``) and itself forever."""
    boxes: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, LoopMailbox] = weakref.WeakKeyDictionary()

    async def main():
        loop = asyncio.get_running_loop()
        boxes[loop] = box = LoopMailbox(loop)
        box.sink(asyncio.Queue())("chunk")

    for _ in range(3):
        asyncio.run(main())
    gc.collect()
    assert len(boxes) == 0


@pytest.fixture(scope="module")
def engine(default_model):
    eng = Engine(
        model=default_model,
        kv_cache_dtype="int8",
        recent_window=32,
        chunked_prefill_size=32,
        max_total_tokens=4096,
        max_running_requests=4,
    )
    yield eng
    eng.shutdown()


def _stream_all(engine: Engine, prompts: list[list[int]], max_new: int) -> tuple[list[list[int]], int, int]:
    """Stream every prompt at once; per prompt the ids the chunks carried, loop wake-ups, chunks."""

    async def one(ids: list[int], out: list[int]) -> int:
        n = 0
        async for chunk in engine.async_generate(
            input_ids=ids, sampling_params={"temperature": 0, "max_new_tokens": max_new, "ignore_eos": True},
            stream=True,
        ):  # fmt: skip
            out.extend(chunk["output_ids"])
            n += 1
        return n

    async def main():
        calls = _counting(asyncio.get_running_loop())
        outs: list[list[int]] = [[] for _ in prompts]
        runs = (one(p, o) for p, o in zip(prompts, outs, strict=True))
        counts = await asyncio.wait_for(asyncio.gather(*runs), 120)
        return outs, calls[0], sum(counts)

    return asyncio.run(main())


@pytest.mark.parametrize("at_sync,overlap", [(False, False), (True, False), (True, True)])
def test_streams_complete_and_equal_generate(engine, default_model, at_sync, overlap):
    prompts = [default_model.tokenizer.encode(p) for p in PROMPTS]
    want = [r["output_ids"] for r in engine.generate(input_ids=prompts, sampling_params={
        "temperature": 0, "max_new_tokens": 12, "ignore_eos": True})]  # fmt: skip
    engine.core.set_flush_at_sync(at_sync)
    engine.core.overlap = overlap  # the CUDA defaults are both on
    try:
        outs, wakeups, chunks = _stream_all(engine, prompts, 12)
    finally:
        engine.core.set_flush_at_sync(False)
        engine.core.overlap = False
    assert outs == want
    assert all(len(o) == 12 for o in outs)
    # 4 streams x 12 tokens: one wake-up per step for all of them, not one per chunk
    assert chunks >= 4 * 12
    assert wakeups <= 12 + 4  # decode steps + prefill steps + a final flush
    stats = engine.check_invariants()
    assert stats.running == 0


def test_engine_builds_both_byte_tables_before_any_request(default_model):
    """Requests are submitted on the caller's thread (the HTTP event loop): the check of a byte table
    (one decode of the whole vocabulary) must not run there on the first request that asks for
    ``skip_special_tokens=False``."""
    from kvstrata.engine import detokenizer

    tok = default_model.tokenizer
    detokenizer._tables.pop(getattr(tok, "inner", tok), None)
    eng = Engine(model=default_model, kv_cache_dtype="int8", recent_window=32, max_total_tokens=1024)
    try:
        assert set(detokenizer._tables[getattr(tok, "inner", tok)]) == {True, False}
    finally:
        eng.shutdown()
