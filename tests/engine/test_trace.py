"""The opt-in step timeline (``KVSTRATA_STEP_TRACE``): one record per step whose token counts add up
to the work the requests did, whichever scheduling mode ran; and its summary's totals."""

from __future__ import annotations

import asyncio
import gc
import statistics
import time
from typing import Any

import pytest
import torch
from prompt_texts import PROMPT_TEXTS

from kvstrata.engine.engine import Engine
from kvstrata.engine.trace import (
    NOT_STEPS,
    TRACE_ENV,
    WARMUP_DONE,
    StepTrace,
    format_timeline,
    read_trace,
    steady_batch,
    step_kind,
    summarize,
)
from kvstrata.server.app import watch_loop_lag

NEW = [5, 9, 1, 12]


@pytest.mark.parametrize("overlap", [False, True])
def test_trace_counts_every_step(default_model, tmp_path, monkeypatch, overlap: bool) -> None:
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(TRACE_ENV, str(path))
    prompts = [default_model.tokenizer.encode(t) for t in PROMPT_TEXTS[: len(NEW)]]
    engine = Engine(
        model=default_model, kv_cache_dtype="auto", page_size=16, max_total_tokens=2048,
        max_running_requests=8, chunked_prefill_size=32,
    )  # fmt: skip
    engine.core.overlap = overlap
    try:
        params = [{"temperature": 0, "max_new_tokens": n, "ignore_eos": True} for n in NEW]
        outs = engine.generate(input_ids=prompts, sampling_params=params)
    finally:
        engine.shutdown()
    assert [len(o["output_ids"]) for o in outs] == NEW
    records = read_trace(path.read_text().splitlines())
    steps = [r for r in records if r["kind"] not in NOT_STEPS]
    # every prompt token once, every generated token but the last fed back once (a step that an
    # overlapped request's finish dropped from its batch still ran its token: counted, at most one each)
    fed = sum(len(p) for p in prompts) + sum(n - 1 for n in NEW)
    total = sum(r["tokens"] for r in steps)
    assert fed <= total <= fed + (len(NEW) if overlap else 0)
    assert {r["kind"] for r in steps} <= {"prefill", "decode", "mixed"}
    assert steps[0]["kind"] == "prefill" and steps[-1]["kind"] == "decode"
    for r in steps:
        parts = r["plan"] + r["launch"] + r["flush"] + r["wait"] + r["post"]
        assert r["wall"] == pytest.approx(parts, abs=0.01) and min(r["plan"], r["launch"], r["post"]) >= 0
        assert "gpu" not in r  # CPU: no device events
    assert [r["t"] for r in steps] == sorted(r["t"] for r in steps)
    timeline = summarize(records)
    assert sum(k.steps for k in timeline.kinds.values()) == len(steps)
    assert sum(k.tokens for k in timeline.kinds.values()) == total
    decodes = [r for r in steps if r["kind"] == "decode"]
    assert timeline.kinds["decode"].steps == len(decodes)
    assert (True in timeline.decode_median) is overlap  # overlap leaves greedy ids on the device
    size = timeline.decode_batch[overlap]
    walls = [r["wall"] for r in decodes if r["deferred"] is overlap and r["batch"] == size]
    assert timeline.decode_median[overlap]["wall"] == pytest.approx(statistics.median(walls))


def test_step_kind() -> None:
    assert step_kind([True, True]) == "decode"
    assert step_kind([False, False]) == "prefill"
    assert step_kind([True, False]) == "mixed"


def test_trace_off_by_default(default_model, monkeypatch) -> None:
    monkeypatch.delenv(TRACE_ENV, raising=False)
    engine = Engine(model=default_model, kv_cache_dtype="auto", max_total_tokens=1024)
    try:
        assert engine.core.trace is None and engine.core.runner.on_launched is None
    finally:
        engine.shutdown()


def test_unwritable_trace_path_is_a_clear_error(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv(TRACE_ENV, str(tmp_path / "no-such-dir" / "t.jsonl"))
    with pytest.raises(ValueError, match=f"{TRACE_ENV}=.*no-such-dir.*cannot write"):
        StepTrace.from_env(torch.device("cpu"))
    monkeypatch.setenv(TRACE_ENV, "")
    assert StepTrace.from_env(torch.device("cpu")) is None


def test_loop_lag_lines(tmp_path) -> None:
    trace = StepTrace(str(tmp_path / "t.jsonl"), torch.device("cpu"))

    async def watch_briefly() -> None:
        task = asyncio.create_task(watch_loop_lag(trace, interval=0.001))
        await asyncio.sleep(0.05)
        task.cancel()

    asyncio.run(watch_briefly())
    trace.close()
    records: list[dict[str, Any]] = read_trace((tmp_path / "t.jsonl").read_text().splitlines())
    assert len(records) >= 5 and all(r["kind"] == "loop" and r["lag"] >= -0.01 for r in records)
    timeline = summarize(records)
    assert timeline.loop_samples == len(records) and timeline.kinds == {}


def test_stalls_are_steps_far_above_their_kinds_median() -> None:
    def step(t: float, kind: str, wall: float) -> dict[str, Any]:
        parts = dict.fromkeys(("plan", "launch", "flush", "wait"), 0.0)
        return {
            "t": t,
            "kind": kind,
            "batch": 4,
            "tokens": 4,
            **parts,
            "post": wall,
            "wall": wall,
            "deferred": True,
        }

    records = [step(i * 0.1, "decode", 20.0) for i in range(9)]
    records += [step(1.0, "decode", 1900.0), step(1.1, "prefill", 200.0), step(1.2, "prefill", 90.0)]
    timeline = summarize(records)
    assert [(s[0], s[1], s[4]) for s in timeline.stalls] == [(1.0, "decode", 1900.0)]
    assert "stalled steps" in format_timeline(timeline)


def test_summary_starts_at_the_warmup_mark() -> None:
    """Steps, lags and collections before the warm-up mark are left out, by time: a step whose CUDA
    events resolved after the mark is written after it but started before."""

    def step(t: float, tokens: int) -> dict[str, Any]:
        parts = dict.fromkeys(("plan", "launch", "flush", "wait"), 0.0)
        return {"t": t, "kind": "decode", "batch": 1, "tokens": tokens, **parts, "post": 5.0, "wall": 5.0,
                "deferred": False}  # fmt: skip

    records = [
        step(0.0, 100),
        step(0.5, 200),
        {"t": 1.0, "kind": "mark", "name": WARMUP_DONE},
        step(0.9, 300),
    ]
    records += [{"t": 0.2, "kind": "loop", "lag": 50.0}, {"t": 0.3, "kind": "gc", "gen": 2, "ms": 400.0}]
    records += [step(2.0, 4), step(2.1, 6), {"t": 2.05, "kind": "loop", "lag": 1.0}]
    timeline = summarize(records)
    assert timeline.warmup_steps == 3 and timeline.kinds["decode"].steps == 2
    assert timeline.kinds["decode"].tokens == 10 and timeline.gc_ms == {}
    assert timeline.loop_samples == 1 and timeline.loop_lag_ms["max"] == 1.0
    assert timeline.span_s == pytest.approx(0.105)
    assert "its 3 steps left out" in format_timeline(timeline)
    assert summarize(records[:2]).warmup_steps == 0  # no mark: everything counts


class FakeEvent:
    """A CUDA event stand-in: recorded at the next of ``times`` (s), passed once ``ready[0]``."""

    def __init__(self, times: list[float], ready: list[bool], **_: Any) -> None:
        self.times, self.ready, self.t = times, ready, 0.0

    def record(self) -> None:
        self.t = self.times.pop(0)

    def query(self) -> bool:
        return self.ready[0]

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, later: FakeEvent) -> float:
        return (later.t - self.t) * 1e3


def test_no_gpu_idle_across_a_wait_for_work(tmp_path, monkeypatch) -> None:
    """``idle`` is the device waiting for the host between steps: none on the step after the engine
    waited for requests, also when the steps' events resolve after that wait."""
    times = [0.0, 0.010, 0.012, 0.020, 5.0, 5.010, 5.011, 5.020]  # start, end of four steps
    ready = [False]
    monkeypatch.setattr(torch.cuda, "Event", lambda **kw: FakeEvent(times, ready, **kw))
    trace = StepTrace(str(tmp_path / "t.jsonl"), torch.device("cpu"))
    trace.cuda = True  # the fake events above; no GPU here

    def step() -> None:
        trace.begin(time.perf_counter(), [1], [True])
        trace.launched()
        trace.end(0.0, 0.0, deferred=False)

    step()
    step()
    trace.waiting()  # their events not passed yet: the wait is queued behind them
    trace.waiting()
    step()
    ready[0] = True
    step()
    trace.close()
    records = read_trace((tmp_path / "t.jsonl").read_text().splitlines())
    assert [r["gpu"] for r in records] == pytest.approx([10.0, 8.0, 10.0, 9.0])
    assert [r.get("idle") for r in records] == [None, pytest.approx(2.0), None, pytest.approx(1.0)]
    trace = StepTrace(str(tmp_path / "t2.jsonl"), torch.device("cpu"))
    trace._last_end = FakeEvent([], ready)
    trace.waiting()  # nothing pending: forgotten at once
    assert trace._last_end is None
    trace.close()


def test_collections_are_recorded(tmp_path) -> None:
    trace = StepTrace(str(tmp_path / "t.jsonl"), torch.device("cpu"))
    gc.collect(1)
    gc.collect(2)
    trace.close()
    assert trace._on_gc not in gc.callbacks
    gc.collect(2)  # after close: not recorded
    records = read_trace((tmp_path / "t.jsonl").read_text().splitlines())
    assert [(r["kind"], r["gen"]) for r in records] == [("gc", 1), ("gc", 2)]
    assert all(r["ms"] >= 0 for r in records)
    assert summarize(records).gc_ms.keys() == {1, 2}


def test_decode_medians_at_the_steady_batch() -> None:
    """A benchmark's warm-up request decodes alone about as many steps as its load decodes at full
    batch: the medians are those of the largest batch size with a tenth of the steps or more (not a
    median over both, which fell between them), and the line says how many steps that is."""

    def step(t: float, batch: int, gpu: float) -> dict[str, Any]:
        parts = dict.fromkeys(("plan", "launch", "flush", "wait", "post"), 0.0)
        return {"t": t, "kind": "decode", "batch": batch, "tokens": batch, **parts, "wall": gpu, "gpu": gpu,
                "idle": 0.0, "deferred": True}  # fmt: skip

    records = [step(i * 0.01, 1, 5.0) for i in range(511)]
    records += [step(6 + i * 0.02, 256, 17.0 + (i % 3)) for i in range(512)]
    records += [step(20 + i * 0.02, 200 + i, 15.0) for i in range(40)]  # the tail, each size once
    timeline = summarize(records)
    assert timeline.decode_batch == {True: 256}
    assert timeline.decode_steps_at_batch == {True: (512, 1063)}
    assert timeline.decode_median[True]["gpu"] == 18.0
    assert "the 512 of 1063 steps at batch 256" in format_timeline(timeline)


def test_steady_batch_without_a_common_size() -> None:
    """A ramp where no batch size holds a tenth of the steps: the most common size (the first of a tie)."""
    assert steady_batch(list(range(1, 21))) == 1
    assert steady_batch([*range(1, 21), 7, 7]) == 7
    assert steady_batch([1] * 5 + [256] * 5 + [100]) == 256
