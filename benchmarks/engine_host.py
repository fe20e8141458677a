"""Host time of the engine thread per decode step at a large batch: planning and reading back.

Served on a GPU, a decode step's host work (scheduling, page reservation and plan, reading the sampled
ids back, appending them, detokenizing, stop checks, streaming deltas) runs beside the GPU's work on the
previous step; where it takes longer than the GPU step, the GPU waits (docs/results-h200.md: fp8 history
at batch 256 on a machine with a slow host, 17.3-18.1 ms a step against 16.9 ms of GPU work). This script
times the two largest parts on CPU, where they do the same work as on a GPU host:
``Scheduler.schedule`` (the trace's ``plan``: picking the step, `StratifiedKVCache.begin_step`) and
``EngineCore._absorb`` (most of ``post``), per decode step at ``--batch`` running requests.

The model is tiny (its forward pass is not timed; the per-request host work does not depend on the
model's size), random weights from a config (``load_format="dummy"``), FP8 history with the shipped
defaults, greedy, ``ignore_eos``; ``--stream`` streams every request to an event loop, as the server
does (each step then also builds and hands over a chunk a request). The median of each part over the
decode steps of ``--repeats`` runs is printed for this code and for ``--baseline`` (another checkout,
measured the same way in a subprocess of the same run), with their ratio. The milliseconds are this
machine's, not a GPU host's: compare the ratio.

    python benchmarks/engine_host.py --baseline /path/to/main/checkout
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from checkout import measure_checkout

from kvstrata.engine.core import EngineCore
from kvstrata.engine.engine import Engine
from kvstrata.engine.scheduler import Scheduler

TINY_LLAMA = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
}
PARTS: dict[str, tuple[type, str]] = {"plan": (Scheduler, "schedule"), "post": (EngineCore, "_absorb")}


def timed(owner: type, name: str, into: list[float]) -> None:
    """Wrap ``owner.name`` so each call's seconds are appended to ``into``."""
    original: Callable[..., Any] = getattr(owner, name)

    def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            into.append(time.perf_counter() - start)

    setattr(owner, name, wrapper)


def measure(args: argparse.Namespace) -> dict[str, float]:
    """Median milliseconds of each part over the decode steps (a run's first step, its prefill, left out)."""
    torch.set_num_threads(1)
    times: dict[str, list[float]] = {part: [] for part in PARTS}
    for part, where in PARTS.items():
        timed(*where, times[part])
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(TINY_LLAMA))
        engine = Engine(
            tmp, load_format="dummy", device="cpu", dtype="float32", kv_cache_dtype=args.codec,
            max_running_requests=args.batch, max_total_tokens=args.batch * (args.prompt + args.new + 32),
            chunked_prefill_size=args.batch * args.prompt, warmup="off", seed=0,
        )  # fmt: skip
        gen = torch.Generator().manual_seed(0)
        prompts = torch.randint(10, TINY_LLAMA["vocab_size"] - 10, (args.batch, args.prompt), generator=gen)
        params = {"max_new_tokens": args.new, "ignore_eos": True, "temperature": 0}
        steps: dict[str, list[float]] = {part: [] for part in PARTS}
        try:
            for run in range(args.repeats + 1):  # the first run is a warm-up
                for found in times.values():
                    found.clear()
                if args.stream:
                    asyncio.run(stream_all(engine, prompts.tolist(), params))
                else:
                    engine.generate(input_ids=prompts.tolist(), sampling_params=params)
                engine.flush_cache()
                for part, found in times.items():
                    steps[part].extend(found[1:] if run else [])
        finally:
            engine.shutdown()
    return {part: statistics.median(found) * 1e3 for part, found in steps.items()}


async def stream_all(engine: Any, prompts: list[list[int]], params: dict[str, Any]) -> None:
    """Every prompt streamed at once through ``async_generate``, as the server's requests are: each
    step's tokens become a chunk a request (``Request.delta``) handed to this event loop."""

    async def one(ids: list[int]) -> None:
        async for _ in engine.async_generate(input_ids=ids, sampling_params=params, stream=True):
            pass

    await asyncio.gather(*(one(ids) for ids in prompts))


def baseline(args: argparse.Namespace) -> dict[str, float]:
    """The same measurement of the code under ``args.baseline`` (a checkout), in a subprocess."""
    options = ("batch", "prompt", "new", "codec", "repeats")
    return measure_checkout(__file__, args.baseline, args, options, flags=("stream",))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, default=256, help="running requests")
    ap.add_argument("--prompt", type=int, default=64, help="prompt tokens a request")
    ap.add_argument("--new", type=int, default=128, help="tokens generated a request")
    ap.add_argument("--codec", default="fp8_e4m3", help="history codec")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (after one warm-up)")
    ap.add_argument("--stream", action="store_true", help="stream every request (the server's case)")
    ap.add_argument("--baseline", help="a checkout whose kvstrata is measured the same way, first")
    ap.add_argument("--json", action="store_true", help="print the result as one JSON line (for --baseline)")
    args = ap.parse_args()
    if args.json:
        print(json.dumps(measure(args)))
        return
    before = baseline(args) if args.baseline else None
    now = measure(args)
    mode = "streamed" if args.stream else "not streamed"
    where = f"batch {args.batch}, {args.codec} history, {mode}, CPU, median"
    print(f"engine thread, host ms per decode step ({where})")
    print("| part | " + ("baseline | " if before else "") + "this code |" + (" ratio |" if before else ""))
    print("|---|" + ("---:|" * (3 if before else 1)))
    for part, ms in now.items():
        if before:
            print(f"| {part} | {before[part]:.3f} | {ms:.3f} | {before[part] / ms:.2f}x |")
        else:
            print(f"| {part} | {ms:.3f} |")


if __name__ == "__main__":
    main()
