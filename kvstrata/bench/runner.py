"""Drive the prompts through an endpoint: Poisson arrivals at ``request_rate`` (inf: all at once),
at most ``max_concurrency`` in flight, a rich progress bar, one warm-up request first."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass

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


async def run_load(
    endpoint: Endpoint, vocab: Vocabulary, prompts: list[Prompt], load: Load
) -> tuple[list[RequestResult], float]:
    """Results in prompt order, and the wall seconds from the first send to the last answer."""
    gaps = arrival_gaps(len(prompts), load.request_rate, load.seed)
    cap = load.max_concurrency or len(prompts)
    limits = httpx.Limits(max_connections=cap + 1, max_keepalive_connections=cap + 1)
    timeout = httpx.Timeout(None, connect=60.0)
    async with httpx.AsyncClient(limits=limits, timeout=timeout, trust_env=False) as client:
        for _ in range(load.warmup_requests):
            warm = await stream_request(client, endpoint, prompts[0], vocab)
            if not warm.success:
                raise RuntimeError(f"the warm-up request failed: {warm.error}")
        gate = asyncio.Semaphore(cap)
        results: list[RequestResult | None] = [None] * len(prompts)
        with _progress(len(prompts), load.progress) as progress:
            task = progress.add_task("requests", total=len(prompts), tokens=0, errors=0)
            counts = {"tokens": 0, "errors": 0}

            async def one(i: int) -> None:
                async with gate:
                    res = await stream_request(client, endpoint, prompts[i], vocab)
                results[i] = res
                counts["tokens" if res.success else "errors"] += res.output_len if res.success else 1
                progress.update(task, advance=1, **counts)

            start = time.perf_counter()
            tasks = []
            for i, gap in enumerate(gaps):
                if gap:
                    await asyncio.sleep(gap)
                tasks.append(asyncio.create_task(one(i)))
            await asyncio.gather(*tasks)
            duration = time.perf_counter() - start
    return [r for r in results if r is not None], duration
