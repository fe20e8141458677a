"""Decode throughput on one GPU: kvstrata with and without CUDA graphs beside transformers ``generate``.

    python benchmarks/decode_graphs_gpu.py [--new 128] [--batches 1,16,64] [--repeats 3] [--kv auto]

The model has SmolLM2-135M's geometry (the default model; its GGUF package is not needed) with random
BF16 weights, written once as safetensors and loaded by both systems, so both run the same weights.
Greedy, EOS ignored, fixed lengths, random prompts of --prompt-len tokens. Per batch size B:
- transformers: ``generate`` on a [B, prompt] batch (no padding: equal lengths), static shapes, greedy;
- kvstrata eager (``disable_cuda_graph=True``) and kvstrata graphs (the default on CUDA): B prompts
  submitted together to ``Engine.generate``.
Decode tokens/s = B * new / (time(new + 1 tokens) - time(1 token)): the prefill and the first token are
taken out. Each figure is the median of --repeats runs; the ratio column divides by transformers
measured in the same run. Rows are printed as they are measured.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections.abc import Callable

import torch

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import load_model

SMOLLM2_135M = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
)


def build_checkpoint(path: str) -> None:
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(**SMOLLM2_135M)
    model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    model.save_pretrained(path)


def timed(fn: Callable[[], None]) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t


def decode_rate(run: Callable[[int], None], batch: int, new: int, repeats: int) -> float:
    """Median decode tokens/s of ``run(n_tokens)`` over the batch, prefill taken out."""
    run(4)  # warm-up
    rates = []
    for _ in range(repeats):
        t_one = timed(lambda: run(1))
        t_all = timed(lambda: run(new + 1))
        rates.append(batch * new / (t_all - t_one))
    return statistics.median(rates)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--new", type=int, default=128, help="decode tokens per request")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kv", default="auto", help="kvstrata history codec (auto: BF16, unquantized)")
    args = ap.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    from transformers import AutoModelForCausalLM

    g = torch.Generator().manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        build_checkpoint(tmp)
        hf = AutoModelForCausalLM.from_pretrained(tmp, dtype=torch.bfloat16).to("cuda").eval()
        model = load_model(tmp, dtype=torch.bfloat16, device="cuda")
        engines = {
            name: Engine(
                model=model,
                kv_cache_dtype=args.kv,
                kv_plan="off",
                max_total_tokens=max(batches) * (args.prompt_len + args.new + 64),
                max_running_requests=max(batches),
                disable_cuda_graph=name == "eager",
            )
            for name in ("eager", "graphs")
        }
        assert engines["graphs"].runner.graphs is not None
        print(
            f"\ndecode tokens/s — SmolLM2-135M geometry, random BF16 weights, kv {args.kv}, "
            f"{args.prompt_len}-token prompts, {args.new} new tokens, median of {args.repeats}; "
            f"{torch.cuda.get_device_name()}, torch {torch.__version__}\n"
        )
        print(
            "| batch | transformers generate | kvstrata eager | kvstrata CUDA graphs | eager / HF "
            "| graphs / HF | graphs ms/step |"
        )
        print("|---:|---:|---:|---:|---:|---:|---:|")
        for batch in batches:
            prompts = torch.randint(100, 49000, (batch, args.prompt_len), generator=g)
            ids = prompts.tolist()
            x = prompts.to("cuda")

            @torch.inference_mode()
            def hf_run(n: int, x: torch.Tensor = x) -> None:
                hf.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    max_new_tokens=n,
                    min_new_tokens=n,
                    do_sample=False,
                    pad_token_id=0,
                )

            def ours(engine: Engine, ids: list[list[int]] = ids) -> Callable[[int], None]:
                def run(n: int) -> None:
                    engine.flush_cache()
                    params = {"temperature": 0, "max_new_tokens": n, "ignore_eos": True}
                    outs = engine.generate(input_ids=ids, sampling_params=params)
                    assert all(len(o["output_ids"]) == n for o in outs)

                return run

            hf_tps = decode_rate(hf_run, batch, args.new, args.repeats)
            eager = decode_rate(ours(engines["eager"]), batch, args.new, args.repeats)
            graphs = decode_rate(ours(engines["graphs"]), batch, args.new, args.repeats)
            print(
                f"| {batch} | {hf_tps:.0f} | {eager:.0f} | {graphs:.0f} | {eager / hf_tps:.2f}x "
                f"| {graphs / hf_tps:.2f}x | {1000 * batch / graphs:.2f} |",
                flush=True,
            )
        for engine in engines.values():
            engine.shutdown()


if __name__ == "__main__":
    main()
