"""A forced fp4 window-0 run served with the drift monitor re-scoring every request (docs/eval.md).

    python benchmarks/drift_raise.py [--model qwen2.5-0.5b] [--requests 30] [--threshold 0.02]

No load-time plan, no sinks, no BF16 window: history is fp4 from the first page, so the drift is what the
codec does. The monitor (metric KL) raises precision at level 1 (`--drift-raise-dtype auto`: new text pages
in the raised pool, fp4 -> int4 keys and fp8 values) and, with hysteresis, steps back down when the drift
stays low. Prints one row per sampled request: the level it was served at, its KL and perplexity ratio,
the EWMA after it and the level after it, then the pages each pool holds.
"""

from __future__ import annotations

import argparse
import logging

import torch


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="qwen2.5-0.5b")
    parser.add_argument("--requests", type=int, default=30)
    parser.add_argument("--prompt-tokens", type=int, default=96)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--threshold", type=float, default=0.02, help="KL (nats/token) that raises precision")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.WARNING, format="%(message)s")

    from kvstrata.engine.drift import DriftSample
    from kvstrata.engine.engine import Engine
    from kvstrata.resources import load_corpus_text

    eng = Engine(
        model=args.model, kv_cache_dtype="fp4_e2m1", recent_window=0, sinks=False, kv_plan="off",
        max_total_tokens=16384, drift_sample_rate=1.0, drift_threshold=args.threshold, drift_metric="kl",
        drift_max_level=0, device="cpu",
    )  # fmt: skip
    samples: list[DriftSample] = []
    eng.subscribe(lambda e: samples.append(e) if isinstance(e, DriftSample) else None)
    paras = [p for p in load_corpus_text().split("\n\n") if len(p) > 600]
    codecs = eng.raised_codecs()
    print(f"raised pool: {codecs[0]} x {len(codecs)} layers, threshold {args.threshold}")
    print("| request | served at level | KL | ppl ratio | EWMA after | level after |")
    print("|---:|---:|---:|---:|---:|---:|")
    try:
        for i, text in enumerate(paras[: args.requests]):
            served = eng.cache.raised
            ids = eng.tokenizer.encode(text)[: args.prompt_tokens]
            params = {"temperature": 0, "max_new_tokens": args.new_tokens, "ignore_eos": True}
            eng.generate(input_ids=ids, sampling_params=params)
            eng.wait_drift_idle(600)
            eng.cache_stats()  # one engine-loop pass: a pending level change is applied
            s = samples[-1]
            print(f"| {i} | {int(served)} | {s.kl:.4f} | {s.ppl_ratio:.3f} | {s.ewma:.4f} | {s.level} |")
        tiers = eng.cache_stats().tiers
        print(f"pages in use: text pool {tiers['cold'].used}, raised pool {tiers['raised'].used}")
    finally:
        eng.shutdown()


if __name__ == "__main__":
    main()
