"""An opt-in timeline of the engine's steps: where served time goes, step by step.

Set ``KVSTRATA_STEP_TRACE=/path/trace.jsonl`` before the engine starts (``kvstrata serve`` passes the
environment on) and every step writes one JSON line:

- ``kind`` (``prefill``, ``decode`` or ``mixed``), ``batch`` (requests), ``tokens`` (new tokens);
- host milliseconds of the engine thread: ``plan`` (the iteration's start to the planned step: inbox,
  drift window, scheduling, page reservation), ``launch`` (building the inputs and queueing the forward
  pass and sampling: the time the device may wait on), ``flush`` (handing streamed chunks to the event
  loop), ``wait`` (blocked on the device for sampled ids), ``post`` (the rest: reading ids back,
  appending tokens, stop checks, deltas, finishing), ``wall`` (all of it);
- on CUDA, from events around the queued work: ``gpu`` (the step's first queued kernel to its last,
  bubbles inside included) and ``idle`` (the previous step's last kernel to this one's first: the
  device waiting for the host; none on a step after the engine waited for work). They are read
  once the device has passed them, never by waiting.

``loop`` lines carry the event loop's lag (``lag``: how late a 5 ms timer fired), written by the server
(`kvstrata.server.app`) through `loop_lag`; ``gc`` lines each collection of the older generations
(``gen`` 1 or 2, ``ms``; `gc.callbacks`, any thread: every thread waits for it); a ``mark`` line
(``name`` `WARMUP_DONE`) the end of the engine's start-up warm-up. `summarize` turns a file into
totals per step kind, medians of the decode steps at the steady batch size, stalled steps,
collections and the idle gaps, from the warm-up mark on; ``benchmarks/step_timeline.py`` prints it.
The cost when on: a dict and two CUDA events per step; off (the default) nothing runs.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import threading
import time
from collections import Counter, deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch

TRACE_ENV = "KVSTRATA_STEP_TRACE"
HOST_PARTS = ("plan", "launch", "flush", "wait", "post")
WARMUP_DONE = "warm-up done"  # the engine's mark after its start-up warm-up (`summarize` starts there)
NOT_STEPS = ("loop", "gc", "mark")


def step_kind(decoding: list[bool]) -> str:
    """``decode``: every request past its prompt; ``prefill``: none; else ``mixed``."""
    if all(decoding):
        return "decode"
    return "mixed" if any(decoding) else "prefill"


class StepTrace:
    """Collects one record per step on the engine thread and writes them as JSON lines."""

    def __init__(self, path: str, device: torch.device) -> None:
        self.path = path
        self.cuda = device.type == "cuda"
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 (closed in `close`)
        self._lock = threading.Lock()  # the event loop's lag lines come from another thread
        self._origin = time.perf_counter()
        self._open: dict[str, Any] | None = None
        self._events: tuple[Any, Any] | None = None
        # steps waiting for their events; None where the engine waited for work between two steps
        self._pending: deque[tuple[dict[str, Any], Any, Any] | None] = deque()
        self._last_end: Any = None  # the previous step's end event
        self._marks: dict[str, float] = {}
        self._gc_start = 0.0
        # Written later by the engine thread: a callback that wrote could re-enter a write of this file
        # (or its lock) when an allocation inside it starts a collection.
        self._collections: list[dict[str, Any]] = []
        gc.callbacks.append(self._on_gc)

    @classmethod
    def from_env(cls, device: torch.device) -> StepTrace | None:
        """The timeline ``KVSTRATA_STEP_TRACE`` asks for, else None; ValueError when it cannot be
        written (`kvstrata serve` reports it as an engine start-up error)."""
        path = os.environ.get(TRACE_ENV)
        if not path:
            return None
        try:
            return cls(path, device)
        except OSError as exc:
            raise ValueError(f"{TRACE_ENV}={path}: cannot write the step timeline ({exc})") from exc

    # --- the engine thread --------------------------------------------------------------------------
    def begin(self, started: float, n_new: list[int], decoding: list[bool]) -> None:
        """A step was planned (``decoding``: per request, whether its prompt is done); ``started`` is
        its iteration's start (perf_counter)."""
        now = time.perf_counter()
        self._open = {
            "t": round(started - self._origin, 6),
            "kind": step_kind(decoding),
            "batch": len(n_new),
            "tokens": sum(n_new),
            "plan": (now - started) * 1e3,
        }
        self._marks = {"started": started, "launch": now}
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
            self._events = (start, None)

    def launched(self) -> None:
        now = time.perf_counter()
        if self._open is None:
            return
        self._open["launch"] = (now - self._marks["launch"]) * 1e3
        if self.cuda and self._events is not None:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events = (self._events[0], end)

    def end(self, flush_s: float, wait_s: float, deferred: bool) -> None:
        """The step's host work is done; ``flush_s`` and ``wait_s`` were spent inside it."""
        rec, self._open = self._open, None
        if rec is None:
            return
        wall = (time.perf_counter() - self._marks["started"]) * 1e3
        rec["flush"], rec["wait"] = flush_s * 1e3, wait_s * 1e3
        rec["post"] = max(0.0, wall - rec["plan"] - rec.get("launch", 0.0) - rec["flush"] - rec["wait"])
        rec["wall"], rec["deferred"] = wall, deferred
        self._write_collections()
        if self.cuda and self._events is not None and self._events[1] is not None:
            self._pending.append((rec, *self._events))
            self._events = None
            self._resolve(block=False)
        else:
            self._write(rec)

    def waiting(self) -> None:
        """The engine has no work: the device's wait until the next step is for requests, not for
        the host, so that step has no ``idle``."""
        if not self._pending:
            self._last_end = None
        elif self._pending[-1] is not None:
            self._pending.append(None)

    def _resolve(self, block: bool) -> None:
        while self._pending:
            head = self._pending[0]
            if head is None:
                self._pending.popleft()
                self._last_end = None
                continue
            rec, start, end = head
            if not block and not end.query():
                return
            end.synchronize()
            self._pending.popleft()
            rec["gpu"] = start.elapsed_time(end)
            if self._last_end is not None:
                rec["idle"] = max(0.0, self._last_end.elapsed_time(start))
            self._last_end = end
            self._write(rec)

    # --- any thread -----------------------------------------------------------------------------------
    def _on_gc(self, phase: str, info: dict[str, Any]) -> None:
        if info.get("generation", 0) < 1:
            return
        now = time.perf_counter()
        if phase == "start":
            self._gc_start = now
        elif self._gc_start:
            at = round(self._gc_start - self._origin, 6)
            ms = (now - self._gc_start) * 1e3
            self._collections.append({"t": at, "kind": "gc", "gen": info["generation"], "ms": ms})

    def _write_collections(self) -> None:
        while self._collections:
            self._write(self._collections.pop(0))

    def mark(self, name: str) -> None:
        """A named point of the timeline (a ``mark`` line): the engine marks the warm-up's end."""
        self._write({"t": round(time.perf_counter() - self._origin, 6), "kind": "mark", "name": name})

    def loop_lag(self, lag_s: float) -> None:
        self._write({"t": round(time.perf_counter() - self._origin, 6), "kind": "loop", "lag": lag_s * 1e3})

    def _write(self, rec: dict[str, Any]) -> None:
        line = json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in rec.items()})
        with self._lock:
            if not self._file.closed:
                self._file.write(line + "\n")

    def close(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)
        self._write_collections()
        if self.cuda:
            self._resolve(block=True)
        with self._lock:
            self._file.close()


# --- summary -----------------------------------------------------------------------------------------
@dataclass
class KindTotals:
    steps: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    gpu_s: float = 0.0
    idle_s: float = 0.0
    host_s: dict[str, float] = field(default_factory=lambda: dict.fromkeys(HOST_PARTS, 0.0))


@dataclass
class Timeline:
    span_s: float
    kinds: dict[str, KindTotals]
    # per decode step at the steady batch size (`steady_batch`): wall, gpu, idle and the host parts
    # (ms); by whether the step's ids stayed on the device (overlap scheduling: True) or were read
    # back before the next step was planned
    decode_median: dict[bool, dict[str, float]]
    decode_batch: dict[bool, int]  # that batch size
    decode_steps_at_batch: dict[bool, tuple[int, int]]  # (decode steps at that size, all of them)
    engine_idle_s: float  # the span less every step's wall time: the engine thread waiting for work
    loop_lag_ms: dict[str, float]  # median, p90, max of the event loop's lag while steps ran
    loop_samples: int
    # Steps slower than STALL_FACTOR x the median wall time of their kind and than STALL_MS:
    # (t, kind, batch, tokens, wall ms). On CUDA mostly Triton compiling a kernel variant on first use.
    stalls: list[tuple[float, str, int, int, float]] = field(default_factory=list)
    gc_ms: dict[int, tuple[int, float, float]] = field(default_factory=dict)  # gen -> count, total, max
    warmup_steps: int = 0  # steps before the warm-up mark, left out of everything above


STALL_FACTOR, STALL_MS = 5.0, 100.0
STEADY_SHARE = 0.1  # a batch size needs this share of the decode steps to be the steady one


def steady_batch(sizes: list[int]) -> int:
    """The largest batch size that at least `STEADY_SHARE` of the decode steps ran at (else the most
    common one): the steady state of a load, where a median over every step can fall between two sizes
    (a benchmark's warm-up request decodes alone as many steps as its load decodes at full batch)."""
    counts = Counter(sizes)
    steady = [size for size, n in counts.items() if n >= STEADY_SHARE * len(sizes)]
    return max(steady) if steady else counts.most_common(1)[0][0]  # no size that common: the most common


def read_trace(lines: Iterable[str]) -> list[dict[str, Any]]:
    return [json.loads(line) for line in lines if line.strip()]


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0


def summarize(records: list[dict[str, Any]]) -> Timeline:
    """Totals per step kind, medians of the decode steps, engine idle time and the loop's lag, from
    the last warm-up mark on (a step resolved after it may be written after it: compared by time)."""
    since = max((r["t"] for r in records if r["kind"] == "mark" and r["name"] == WARMUP_DONE), default=None)
    warmup_steps = 0
    if since is not None:
        warmup_steps = sum(1 for r in records if r["kind"] not in NOT_STEPS and r["t"] < since)
        records = [r for r in records if r["t"] >= since]
    steps = [r for r in records if r["kind"] not in NOT_STEPS]
    first, last = (steps[0]["t"], steps[-1]["t"] + steps[-1]["wall"] / 1e3) if steps else (0.0, 0.0)
    # the loop's lag while steps ran (all of it when the file has no step)
    lags = [r["lag"] for r in records if r["kind"] == "loop" and (not steps or first <= r["t"] <= last)]
    gcs = [r for r in records if r["kind"] == "gc" and (not steps or first <= r["t"] <= last)]
    kinds: dict[str, KindTotals] = {}
    for r in steps:
        k = kinds.setdefault(r["kind"], KindTotals())
        k.steps += 1
        k.tokens += r["tokens"]
        k.wall_s += r["wall"] / 1e3
        k.gpu_s += r.get("gpu", 0.0) / 1e3
        k.idle_s += r.get("idle", 0.0) / 1e3
        for part in HOST_PARTS:
            k.host_s[part] += r.get(part, 0.0) / 1e3
    span = last - first
    median: dict[bool, dict[str, float]] = {}
    batch: dict[bool, int] = {}
    counted: dict[bool, tuple[int, int]] = {}
    for deferred in (False, True):
        decodes = [r for r in steps if r["kind"] == "decode" and r["deferred"] is deferred]
        if decodes:
            size = steady_batch([r["batch"] for r in decodes])
            at = [r for r in decodes if r["batch"] == size]
            keys = ("wall", "gpu", "idle", *HOST_PARTS)
            median[deferred] = {key: statistics.median(r.get(key, 0.0) for r in at) for key in keys}
            batch[deferred] = size
            counted[deferred] = (len(at), len(decodes))
    walls: dict[str, list[float]] = {}
    for r in steps:
        walls.setdefault(r["kind"], []).append(r["wall"])
    typical = {kind: statistics.median(w) for kind, w in walls.items()}
    stalls = [
        (r["t"], r["kind"], r["batch"], r["tokens"], r["wall"])
        for r in steps
        if r["wall"] > max(STALL_MS, STALL_FACTOR * typical[r["kind"]])
    ]
    gc_ms = {
        gen: (len(ms), sum(ms), max(ms))
        for gen in (1, 2)
        if (ms := [r["ms"] for r in gcs if r["gen"] == gen])
    }
    return Timeline(
        gc_ms=gc_ms,
        stalls=stalls,
        span_s=span,
        kinds=kinds,
        decode_median=median,
        decode_batch=batch,
        decode_steps_at_batch=counted,
        engine_idle_s=max(0.0, span - sum(k.wall_s for k in kinds.values())),
        loop_lag_ms={
            "median": statistics.median(lags) if lags else 0.0,
            "p90": _quantile(lags, 0.9),
            "max": max(lags, default=0.0),
        },
        loop_samples=len(lags),
        warmup_steps=warmup_steps,
    )


def format_timeline(t: Timeline) -> str:
    warmup = f" (after the warm-up: its {t.warmup_steps} steps left out)" if t.warmup_steps else ""
    rows = [
        f"span {t.span_s:.2f} s{warmup}; engine thread waiting for work {t.engine_idle_s:.2f} s",
        "",
        "| steps | count | tokens | wall s | GPU s | GPU idle s | plan | launch | flush | wait | post (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, k in sorted(t.kinds.items()):
        cells = [f"{x:.2f}" for x in (k.wall_s, k.gpu_s, k.idle_s, *(k.host_s[p] for p in HOST_PARTS))]
        rows.append(f"| {name} | {k.steps} | {k.tokens:,} | " + " | ".join(cells) + " |")
    rows.append("")
    for deferred, m in t.decode_median.items():
        at, of = t.decode_steps_at_batch[deferred]
        rows.append(
            f"decode step medians ({'ids left on the device' if deferred else 'ids read back'}, the {at} "
            f"of {of} steps at batch {t.decode_batch[deferred]}): wall {m['wall']:.2f} ms, "
            f"GPU {m['gpu']:.2f} ms, "
            f"GPU idle before it {m['idle']:.2f} ms; host: "
            + ", ".join(f"{p} {m[p]:.2f}" for p in HOST_PARTS)
            + " ms"
        )
    stall_s = sum(wall for *_, wall in t.stalls) / 1e3
    rows.append(
        f"stalled steps (> {STALL_FACTOR:g}x their kind's median wall, > {STALL_MS:g} ms): "
        f"{len(t.stalls)}, {stall_s:.2f} s"
        + "".join(
            f"\n  t={at:.2f} s {kind} batch {b} tokens {n}: {wall:.0f} ms"
            for at, kind, b, n, wall in t.stalls
        )
    )
    rows.append(
        "garbage collections while steps ran: "
        + (
            "; ".join(
                f"gen {g}: {n}, {tot:.1f} ms in all, longest {top:.1f} ms"
                for g, (n, tot, top) in t.gc_ms.items()
            )
            or "none of generation 1 or 2"
        )
    )
    rows += [
        f"event loop lag over {t.loop_samples} samples: median {t.loop_lag_ms['median']:.2f} ms, "
        f"p90 {t.loop_lag_ms['p90']:.2f} ms, max {t.loop_lag_ms['max']:.2f} ms",
    ]
    return "\n".join(rows)
