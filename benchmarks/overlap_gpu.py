"""Decode steps/s of the engine with overlap scheduling off and on, in one process on one GPU.

    python benchmarks/overlap_gpu.py [--batch 256] [--context 1536] [--new 128] [--kv auto,fp8_e4m3]
                                     [--repeats 1] [--geometry llama3-8b] [--device cuda]

Llama-3-8B geometry with random BF16 weights (`dummy_model`, as `--load-format dummy`; nothing is read
or downloaded). One `Engine` per history codec (CUDA graphs up to ``--batch``); ``--batch`` requests of
``--context`` random prompt tokens each generate ``--new`` tokens greedily (``ignore_eos``), all at
once, so after the prefill steps every step is a decode step at B = ``--batch``. The engine's
``core.overlap`` is switched between runs while it is idle (off, on, off, on, ... ``--repeats`` times
each; the two modes of a repeat run the same random prompts, and the prefix cache is emptied before
every run, so no run reads another's pages). A warm-up run at B with 64-token prompts comes first.
Each run prefills B x ``--context`` tokens (about 393K by default): keep ``--repeats`` small.

Printed per codec and mode: the decode step interval (median over all requests of the median gap
between a request's consecutive tokens), steps/s, output tokens/s of the whole run (prefill included),
and whether the greedy tokens of the two modes agree token for token; then the ratio on/off of the
steps/s (the baseline: overlap off, measured in the same run).

``--geometry tiny --device cpu`` runs the same code on a small model on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from decode_step_gpu import GEOMETRIES  # run as `python benchmarks/overlap_gpu.py`

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import load_model
from kvstrata.engine.stats import RequestFinished


def run_once(
    engine: Engine, overlap: bool, args: argparse.Namespace, seed: int, context: int | None = None
) -> dict[str, float | str]:
    """One batch of requests; returns the step interval, the output rate and a checksum of the tokens."""
    engine.core.overlap = overlap  # the engine is idle: read at its next step
    while not engine.flush_cache():  # the other mode's run of the same prompts leaves no prefix to hit
        time.sleep(0.01)
    gen = torch.Generator().manual_seed(seed)
    vocab = engine.config.vocab_size
    prompts = torch.randint(0, vocab, (args.batch, context or args.context), generator=gen).tolist()
    params = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    gaps: list[float] = []

    def on_event(event: object) -> None:
        if isinstance(event, RequestFinished) and event.inter_token_latencies:
            gaps.append(statistics.median(event.inter_token_latencies))

    unsubscribe = engine.subscribe(on_event)
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    wall = time.perf_counter() - start
    unsubscribe()
    tokens = [o["output_ids"] for o in outs]
    assert all(len(t) == args.new for t in tokens), "a request ended early"
    step = statistics.median(gaps)
    return {
        "step_ms": step * 1e3,
        "steps_s": 1.0 / step,
        "out_tok_s": args.batch * args.new / wall,
        "checksum": hashlib.sha256(repr(tokens).encode()).hexdigest()[:12],
        "deferred": engine.core.deferred_steps,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=1536, help="prompt tokens per request")
    ap.add_argument("--new", type=int, default=128, help="tokens generated per request")
    ap.add_argument("--kv", default="auto,fp8_e4m3", help="history codecs, comma separated")
    ap.add_argument("--repeats", type=int, default=1, help="runs per mode, alternating")
    ap.add_argument("--geometry", default="llama3-8b", choices=list(GEOMETRIES))
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model_dir = Path(tempfile.mkdtemp(prefix="kvstrata-overlap-"))
    (model_dir / "config.json").write_text(json.dumps(GEOMETRIES[args.geometry]))
    model = load_model(str(model_dir), dtype=dtype, device=device, load_format="dummy")
    print(f"device: {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}; {args.geometry}, "
          f"B={args.batch}, {args.context} prompt + {args.new} new tokens per request")  # fmt: skip
    print("\n| history | overlap | step ms | steps/s | output tok/s | tokens (sha) |")
    print("|---|---|---:|---:|---:|---|")
    ratios: dict[str, float] = {}
    for kv in args.kv.split(","):
        engine = Engine(
            model=model,
            kv_cache_dtype=kv,
            max_running_requests=args.batch,
            cuda_graph_max_bs=args.batch,
            max_total_tokens=args.batch * (args.context + args.new + 64),
        )
        try:
            runs: dict[bool, list[dict[str, float | str]]] = {False: [], True: []}
            run_once(engine, True, args, seed=-1, context=64)  # warm-up at B: graphs, Triton variants
            for seed in range(args.repeats):
                for overlap in (False, True):
                    runs[overlap].append(run_once(engine, overlap, args, seed))
            for overlap in (False, True):
                got = runs[overlap]
                step = statistics.median(float(r["step_ms"]) for r in got)
                rate = statistics.median(float(r["out_tok_s"]) for r in got)
                sums = ",".join(str(r["checksum"]) for r in got)
                mode = "on" if overlap else "off"
                print(f"| {kv} | {mode} | {step:.2f} | {1e3 / step:.1f} | {rate:.0f} | {sums} |")
            off = statistics.median(float(r["steps_s"]) for r in runs[False])
            on = statistics.median(float(r["steps_s"]) for r in runs[True])
            ratios[kv] = on / off
            same = [a["checksum"] == b["checksum"] for a, b in zip(runs[False], runs[True], strict=True)]
            deferred = engine.core.deferred_steps
            print(f"|  | tokens equal on/off: {all(same)} | deferred steps: {deferred} | | | |")
        finally:
            engine.shutdown()
    print()
    for kv, r in ratios.items():
        print(f"{kv}: steps/s overlap on / off = {r:.3f}")


if __name__ == "__main__":
    main()
