"""Drive the prompts through an endpoint: Poisson arrivals at ``request_rate`` (inf: all at once),
at most ``max_concurrency`` in flight, a rich progress bar, one warm-up request first.

``num_workers`` > 1 spreads the requests over that many client processes (round robin, each with its
share of the concurrency cap and its own event loop), started together once all hold their jobs. One
Python event loop reading hundreds of token streams falls behind the server: on an H200 serving 256
streams of about 50 tokens/s each (~13K events/s), a single process measured a median ITL of 20.9 ms
(fp8) and 30.2 ms (BF16) where SGLang's ``bench_serving`` (aiohttp) measured 18.7 and 23.1 on the same
server code; a late read splits one step's gap into a short and a long one."""

from __future__ import annotations

import asyncio
import contextlib
import math
import multiprocessing
import queue
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import numpy as np
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from kvstrata.bench.client import Endpoint, stream_request
from kvstrata.bench.metrics import RequestResult
from kvstrata.bench.prompts import Prompt, Vocabulary


@dataclass(frozen=True)
class Load:
    request_rate: float = math.inf  # requests per second; inf sends them all at once
    max_concurrency: int | None = None  # None: no cap
    seed: int = 1
    warmup_requests: int = 1
    progress: bool = True
    num_workers: int = 1  # client processes (see the module docstring)


def arrival_gaps(num: int, request_rate: float, seed: int) -> list[float]:
    """Seconds to wait before each send: exponential gaps of mean ``1 / request_rate`` (a Poisson
    process, as SGLang's ``bench_serving``), all zero when the rate is infinite."""
    if request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0, got {request_rate}")
    if math.isinf(request_rate):
        return [0.0] * num
    rng = np.random.default_rng(seed)
    return [float(g) for g in rng.exponential(1.0 / request_rate, size=num)]


@contextlib.contextmanager
def _progress(total: int, enabled: bool) -> Iterator[Progress]:
    columns = (
        TextColumn("[bold]kvstrata bench"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[tokens]} out tok"),
        TextColumn("{task.fields[errors]} errors"),
        TimeElapsedColumn(),
    )
    with Progress(*columns, disable=not enabled, transient=False) as progress:
        yield progress


# (prompt index, prompt, seconds after the common start at which it is sent)
Job = tuple[int, Prompt, float]


def _client(cap: int) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=cap + 1, max_keepalive_connections=cap + 1)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(None, connect=60.0), trust_env=False)


async def _drive(
    endpoint: Endpoint,
    vocab: Vocabulary,
    jobs: list[Job],
    cap: int,
    start: float,
    done: Callable[[RequestResult], None],
) -> tuple[list[tuple[int, RequestResult]], float]:
    """Send ``jobs`` at ``start`` (`time.monotonic`) + their offsets, at most ``cap`` in flight; the
    results with their prompt indices, and the monotonic time the last one ended."""
    gate = asyncio.Semaphore(cap)
    out: list[tuple[int, RequestResult]] = []
    async with _client(cap) as client:

        async def one(i: int, prompt: Prompt) -> None:
            async with gate:
                res = await stream_request(client, endpoint, prompt, vocab)
            out.append((i, res))
            done(res)

        tasks = []
        for i, prompt, offset in jobs:
            wait = start + offset - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(i, prompt)))
        await asyncio.gather(*tasks)
    return out, time.monotonic()


def _worker(
    endpoint: Endpoint, vocab: Vocabulary, jobs: list[Job], cap: int, go: Any, events: Any
) -> tuple[list[tuple[int, RequestResult]], float, float]:
    """One client process: its jobs on its own event loop, sent from the instant every worker holds its
    jobs (``go``, a barrier: the pool hands the workers their arguments one after another, so a start
    time fixed by the parent found some still unpacking them); each result's (success, tokens) to
    ``events``. Returns the results, and the monotonic times of the start and of the last answer."""
    go.wait(timeout=300)
    start = time.monotonic()
    out, end = asyncio.run(
        _drive(endpoint, vocab, jobs, cap, start, lambda r: events.put((r.success, r.output_len)))
    )
    return out, start, end


async def run_load(
    endpoint: Endpoint, vocab: Vocabulary, prompts: list[Prompt], load: Load
) -> tuple[list[RequestResult], float]:
    """Results in prompt order, and the wall seconds from the first send to the last answer."""
    if load.num_workers < 1:
        raise ValueError(f"--num-workers must be >= 1, got {load.num_workers}")
    gaps = arrival_gaps(len(prompts), load.request_rate, load.seed)
    offsets = np.cumsum(gaps).tolist() if gaps else []
    jobs: list[Job] = [(i, p, o) for i, (p, o) in enumerate(zip(prompts, offsets, strict=True))]
    cap = load.max_concurrency or len(prompts)
    async with _client(1) as client:
        for _ in range(load.warmup_requests):
            warm = await stream_request(client, endpoint, prompts[0], vocab)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
    results: list[RequestResult | None] = [None] * len(prompts)
    with _progress(len(prompts), load.progress) as progress:
        task = progress.add_task("requests", total=len(prompts), tokens=0, errors=0)
        counts = {"tokens": 0, "errors": 0}

        def done(success: bool, tokens: int) -> None:
            counts["tokens" if success else "errors"] += tokens if success else 1
            progress.update(task, advance=1, **counts)

        def report(res: RequestResult) -> None:
            done(res.success, res.output_len)

        workers = min(load.num_workers, len(prompts), cap)
        if workers == 1:
            start = time.monotonic()
            got, end = await _drive(endpoint, vocab, jobs, cap, start, report)
        else:
            got, start, end = await _in_workers(endpoint, vocab, jobs, cap, workers, done)
    for i, res in got:
        results[i] = res
    return [r for r in results if r is not None], end - start


async def _in_workers(
    endpoint: Endpoint,
    vocab: Vocabulary,
    jobs: list[Job],
    cap: int,
    workers: int,
    done: Callable[[bool, int], None],
) -> tuple[list[tuple[int, RequestResult]], float, float]:
    """``jobs`` round robin over ``workers`` spawned processes, the cap split as evenly (each at least
    one), all starting together once each is up and holds its jobs (`_worker`); the duration runs from
    the first worker's start (Linux's monotonic clock is system-wide) to the last answer."""
    ctx = multiprocessing.get_context("spawn")
    shares = [jobs[w::workers] for w in range(workers)]
    caps = [max(1, cap // workers + (w < cap % workers)) for w in range(workers)]
    loop = asyncio.get_running_loop()
    with ctx.Manager() as manager, ProcessPoolExecutor(workers, mp_context=ctx) as pool:
        events = manager.Queue()
        # Every worker up (interpreter, imports) before the clock starts: each first task waits for all
        # the others, so each runs in a process of its own. (Without it, the first worker up took every
        # warm-up task and the others started their requests seconds late: concurrency 195 of 256.)
        barrier = manager.Barrier(workers)
        go = manager.Barrier(workers)
        try:
            list(pool.map(_ready, [barrier] * workers))
            futures = [
                loop.run_in_executor(pool, _worker, endpoint, vocab, share, c, go, events)
                for share, c in zip(shares, caps, strict=True)
            ]
            finished = asyncio.gather(*futures)
            while True:  # progress until every worker has returned (or one failed: gather raises)
                try:
                    success, tokens = await loop.run_in_executor(None, events.get, True, 0.2)
                except queue.Empty:
                    if finished.done():
                        break
                    continue
                done(success, tokens)
            parts = finished.result()
        except BaseException:
            # A worker that failed before a barrier would leave the others waiting there until its
            # timeout, and the pool's shutdown with them: release them (they raise BrokenBarrierError).
            barrier.abort()
            go.abort()
            raise
    got = [item for part, _, _ in parts for item in part]
    return got, min(start for _, start, _ in parts), max(end for _, _, end in parts)


def _ready(barrier: Any) -> bool:
    """A worker's first task: wait until every worker has started."""
    barrier.wait(timeout=300)
    return True
