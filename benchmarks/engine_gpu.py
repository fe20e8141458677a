"""The default model on one GPU: greedy agreement with transformers, and throughput beside it.

    python benchmarks/engine_gpu.py [--model PATH.gguf] [--device cuda] [--new 128]

Prints two markdown tables:
- agreement: the float32 engine (kv_cache_dtype "auto") against transformers ``generate`` (greedy, float32,
  same weights) token for token; and fp8_e4m3 against "auto" on a bfloat16 model (share of prompts whose
  first 16 tokens agree, mean agreeing length);
- throughput (bfloat16): decode tokens/s at batch 1 and aggregate tokens/s of 8 concurrent requests, for
  "auto" and fp8_e4m3, beside transformers' single-stream ``generate`` measured in the same run.
Every time is the median of --repeats runs, ours and transformers alternating.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
from pathlib import Path

import torch

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import converted_dir, load_model

PROMPTS = [
    "The history of the Roman Empire",
    "Photosynthesis is the process by which green plants",
    "Here is a short story about a lighthouse keeper:\n\n",
    "def fibonacci(n):\n",
    "The three laws of thermodynamics are",
    "In 1969, the Apollo 11 mission",
    "A good recipe for pancakes needs",
    "The capital cities of Europe include",
]


def hf_model(source, dtype: torch.dtype, device: str):
    from transformers import AutoModelForCausalLM

    source = Path(source)
    path = converted_dir(source) if source.suffix == ".gguf" else source
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(device).eval()


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


@torch.inference_mode()
def hf_generate(hf, ids: list[int], new: int) -> tuple[list[int], float]:
    x = torch.tensor([ids], device=hf.device)
    _sync()
    t = time.perf_counter()
    out = hf.generate(
        x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False
    )
    _sync()
    return out[0, len(ids) :].tolist(), time.perf_counter() - t


def engine_for(model, kv: str) -> Engine:
    return Engine(model=model, kv_cache_dtype=kv, max_total_tokens=32768, max_running_requests=8)


def greedy(engine: Engine, ids: list[list[int]], new: int) -> list[list[int]]:
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    return [o["output_ids"] for o in engine.generate(input_ids=ids, sampling_params=params)]


def agreeing(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded model)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--new", type=int, default=128, help="tokens generated per request in throughput runs")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.model is None:
        from kvstrata.resources import default_model_path

        args.model = default_model_path()
    dev = args.device

    # ---- agreement -------------------------------------------------------------------------------
    fp32 = load_model(args.model, dtype=torch.float32, device=dev)
    ids = [fp32.tokenizer.encode(p) for p in PROMPTS]
    hf32 = hf_model(args.model, torch.float32, dev)
    ref = [hf_generate(hf32, p, 64)[0] for p in ids]
    del hf32
    eng = engine_for(fp32, "auto")
    ours = greedy(eng, ids, 64)
    eng.shutdown()
    del fp32, eng
    exact = sum(a == b for a, b in zip(ours, ref, strict=True))
    lengths = [agreeing(a, b) for a, b in zip(ours, ref, strict=True)]

    bf16 = load_model(args.model, dtype=torch.bfloat16, device=dev)
    runs = {}
    for kv in ("auto", "fp8_e4m3"):
        eng = engine_for(bf16, kv)
        runs[kv] = greedy(eng, ids, 64)
        eng.shutdown()
    fp8_len = [agreeing(a, b) for a, b in zip(runs["fp8_e4m3"], runs["auto"], strict=True)]
    where = torch.cuda.get_device_name() if torch.device(dev).type == "cuda" else dev
    print(f"\nagreement — {args.model} on {where}, torch {torch.__version__}\n")
    print("| check | result |")
    print("|---|---|")
    print(
        f"| float32, kv auto vs transformers generate (64 tokens) | {exact}/{len(ids)} prompts identical, "
        f"mean agreeing length {statistics.mean(lengths):.1f} |"
    )
    first16 = sum(n >= 16 for n in fp8_len)
    print(
        f"| bfloat16, fp8_e4m3 vs auto (64 tokens) | {first16}/{len(ids)} agree on the first 16 tokens, "
        f"mean agreeing length {statistics.mean(fp8_len):.1f} |"
    )

    # ---- throughput (bfloat16) ---------------------------------------------------------------------
    hf16 = hf_model(args.model, torch.bfloat16, dev)
    short = ids[0]
    hf_generate(hf16, short, 8)

    def hf_decode() -> float:
        _, t_all = hf_generate(hf16, short, args.new + 1)
        _, t_one = hf_generate(hf16, short, 1)
        return args.new / (t_all - t_one)

    rows = []
    params = {"temperature": 0, "ignore_eos": True}
    for kv in ("auto", "fp8_e4m3"):
        eng = engine_for(bf16, kv)
        eng.generate(input_ids=short, sampling_params={**params, "max_new_tokens": 8})

        def decode(eng: Engine = eng) -> float:
            eng.flush_cache()
            t = time.perf_counter()
            eng.generate(input_ids=short, sampling_params={**params, "max_new_tokens": 1})
            t1 = time.perf_counter() - t
            eng.flush_cache()
            t = time.perf_counter()
            eng.generate(input_ids=short, sampling_params={**params, "max_new_tokens": args.new + 1})
            return args.new / (time.perf_counter() - t - t1)

        def concurrent(eng: Engine = eng) -> float:
            eng.flush_cache()
            out: list[dict] = []
            p = {**params, "max_new_tokens": args.new}
            t = time.perf_counter()
            workers = [
                threading.Thread(target=lambda i=i: out.append(eng.generate(input_ids=i, sampling_params=p)))
                for i in ids
            ]
            for w in workers:
                w.start()
            for w in workers:
                w.join()
            return sum(len(o["output_ids"]) for o in out) / (time.perf_counter() - t)

        a, b, c = [], [], []
        for _ in range(args.repeats):
            a.append(decode())
            b.append(hf_decode())
            c.append(concurrent())
        eng.shutdown()
        hf_tps = statistics.median(b)
        rows.append((f"decode tokens/s, batch 1, kv {kv}", statistics.median(a), hf_tps))
        rows.append(
            (f"aggregate tokens/s, 8 concurrent, kv {kv} (vs HF single stream)", statistics.median(c), hf_tps)
        )
    print(f"\nthroughput — bfloat16, {args.new} new tokens, median of {args.repeats}\n")
    print("| measure | kvstrata | transformers | ratio |")
    print("|---|---:|---:|---:|")
    for name, ours_tps, ref_tps in rows:
        print(f"| {name} | {ours_tps:.1f} | {ref_tps:.1f} | {ours_tps / ref_tps:.2f}x |")


if __name__ == "__main__":
    main()
