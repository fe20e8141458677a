"""kvstrata.Engine against Hugging Face transformers `generate` on the same weights, dtype and threads.

    .venv/bin/python benchmarks/engine_cpu.py [--kv-cache-dtype auto] [--threads N] [--decode-tokens 64]

Measures, for the default model (SmolLM2-135M-Instruct, float32 on CPU):
- prefill tokens/s at batch 1 (a 512-token prompt, time to first token, cache flushed);
- decode tokens/s at batch 1 (after the first token);
- aggregate tokens/s of 8 concurrent requests, against transformers' single-stream decode;
- time to first token of a 1,000-token prompt, cold and with the prompt cached.
Prints a markdown table with the ratios. Every number is the median of --repeats runs, ours and
transformers alternating, so that load from other processes on a shared machine hits both alike.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time

import torch

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import converted_dir, load_model
from kvstrata.resources import default_model_path, load_corpus_text


def corpus_ids(tokenizer, n: int, offset: int = 0) -> list[int]:
    text = load_corpus_text()[offset * 20_000 : offset * 20_000 + 40_000]
    ids = tokenizer.encode(text)
    assert len(ids) >= n
    return ids[:n]


def paired(ours, ref, repeats: int) -> tuple[float, float]:
    """Medians of ``ours()`` and ``ref()`` run alternately, so load on a shared machine hits both."""
    a, b = [], []
    for _ in range(repeats):
        a.append(ours())
        b.append(ref())
    return statistics.median(a), statistics.median(b)


class HF:
    def __init__(self, dtype: torch.dtype) -> None:
        from transformers import AutoModelForCausalLM

        path = str(converted_dir(default_model_path()))
        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()

    @torch.inference_mode()
    def generate_time(self, ids: list[int], new: int) -> float:
        x = torch.tensor([ids])
        t = time.perf_counter()
        out = self.model.generate(
            x, attention_mask=torch.ones_like(x), max_new_tokens=new, min_new_tokens=new, do_sample=False
        )
        dt = time.perf_counter() - t
        assert out.shape[1] == len(ids) + new
        return dt


def engine_run(engine: Engine, ids: list[int], new: int) -> dict:
    params = {"temperature": 0, "max_new_tokens": new, "ignore_eos": True}
    t = time.perf_counter()
    out = engine.generate(input_ids=ids, sampling_params=params)
    out["wall"] = time.perf_counter() - t
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    ap.add_argument("--decode-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--only",
        default="prefill,decode,concurrent,ttft",
        help="comma-separated subset of prefill,decode,concurrent,ttft (default: all)",
    )
    args = ap.parse_args()
    only = set(args.only.split(","))
    if args.threads:
        torch.set_num_threads(args.threads)
    threads = torch.get_num_threads()
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[args.dtype]
    model = load_model(None, dtype=dtype)
    tok = model.tokenizer
    engine = Engine(
        model=model, kv_cache_dtype=args.kv_cache_dtype, max_total_tokens=16384, max_running_requests=8
    )
    hf = HF(dtype)
    n_dec, reps = args.decode_tokens, args.repeats
    short = corpus_ids(tok, 32, offset=1)
    p512 = corpus_ids(tok, 512, offset=2)
    p1000 = corpus_ids(tok, 1000, offset=3)

    def warm() -> None:
        engine_run(engine, short, 4)
        hf.generate_time(short, 4)

    warm()

    # --- prefill at batch 1 (cold: flush the tree first) -----------------------------------------
    def ours_prefill() -> float:
        engine.flush_cache()
        return engine_run(engine, p512, 1)["wall"]

    rows = []
    if "prefill" in only:
        ours_pre, hf_pre = paired(ours_prefill, lambda: hf.generate_time(p512, 1), reps)
        rows.append(("prefill tokens/s, batch 1 (512-token prompt)", 512 / ours_pre, 512 / hf_pre, None))

    # --- decode at batch 1 ---------------------------------------------------------------------
    def ours_decode() -> float:
        engine.flush_cache()
        t1 = engine_run(engine, short, 1)["wall"]
        engine.flush_cache()
        tn = engine_run(engine, short, n_dec + 1)["wall"]
        return n_dec / (tn - t1)

    def hf_decode() -> float:
        return n_dec / (hf.generate_time(short, n_dec + 1) - hf.generate_time(short, 1))

    if "decode" in only:
        ours_dec, hf_dec = paired(ours_decode, hf_decode, reps)
        rows.append(("decode tokens/s, batch 1", ours_dec, hf_dec, 1.0))

    # --- 8 concurrent requests -------------------------------------------------------------------
    prompts = [corpus_ids(tok, 24 + 8 * i, offset=4 + i) for i in range(8)]

    def ours_concurrent() -> float:
        engine.flush_cache()
        results: list[dict] = []
        params = {"temperature": 0, "max_new_tokens": n_dec, "ignore_eos": True}
        t = time.perf_counter()
        workers = [
            threading.Thread(
                target=lambda p=p: results.append(engine.generate(input_ids=p, sampling_params=params))
            )
            for p in prompts
        ]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        dt = time.perf_counter() - t
        return sum(r["meta_info"]["completion_tokens"] for r in results) / dt

    if "concurrent" in only:
        ours_conc, hf_dec2 = paired(ours_concurrent, hf_decode, reps)
        rows.append(("aggregate tokens/s, 8 concurrent (vs HF single stream)", ours_conc, hf_dec2, 4.0))

    # --- TTFT of a 1,000-token prompt, cold and cached -------------------------------------------
    def ours_ttft(cached: bool) -> float:
        engine.flush_cache()
        if cached:
            engine_run(engine, p1000, 1)
        return engine_run(engine, p1000, 1)["wall"]

    if "ttft" in only:
        ttft_cold, hf_ttft = paired(lambda: ours_ttft(False), lambda: hf.generate_time(p1000, 1), reps)
        ttft_cached, _ = paired(lambda: ours_ttft(True), lambda: 0.0, reps)
        rows.append(("TTFT cold, 1,000-token prompt (s)", ttft_cold, hf_ttft, None))
        rows.append(("TTFT cached, 1,000-token prompt (s)", ttft_cached, hf_ttft, None))
    engine.shutdown()

    print(
        f"\nkvstrata.Engine vs transformers {_hf_version()} generate — default model, {args.dtype}, "
        f"kv_cache_dtype={args.kv_cache_dtype}, {threads} torch threads, median of {reps}\n"
    )
    print("| measure | kvstrata | transformers | ratio | goal |")
    print("|---|---:|---:|---:|---|")
    for name, ours, ref, goal in rows:
        ratio = ours / ref
        goal_s = f">= {goal:.1f}x" if goal else ""
        print(f"| {name} | {ours:.3g} | {ref:.3g} | {ratio:.2f}x | {goal_s} |")
    if "ttft" in only:
        share = ttft_cached / ttft_cold
        cells = f"{ttft_cached:.3g} | {ttft_cold:.3g} | {share:.2f}x"
        print(f"| TTFT cached / cold (kvstrata) | {cells} | <= 0.2x |")


def _hf_version() -> str:
    import transformers

    return transformers.__version__


if __name__ == "__main__":
    main()
