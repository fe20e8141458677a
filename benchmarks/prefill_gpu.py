"""Prompt throughput of the engine on one GPU: prefill tokens/s and TTFT beside the model's dense forward.

    python benchmarks/prefill_gpu.py [--config ../.sgl/model] [--prompts 128] [--input-len 1536] \
        [--new 16] [--chunk 8192] [--policy prefill,mixed] [--decodes 250]

Llama-3-8B geometry with random BF16 weights (`dummy_model`; ``--config`` a model directory or
``config.json``, e.g. the SGLang recipe's ``model/``, whose vocabulary is smaller). Three parts:

1. **One step** of ``chunk // input_len`` fresh prompts of ``input_len`` random tokens (7,680 tokens at
   the defaults), as the engine runs it (``cache.begin_step`` + `StepRunner.run`, the Triton backend
   over a real cache, page quantize, sampling), timed (median of ``--steps`` after one warm-up) and
   profiled (torch.profiler: kernel-busy time against wall time, kernels by kind and by name), beside
   the same tokens through the model's own dense forward (`Transformer.dense_forward`: causal torch
   SDPA, no cache): the ceiling for this model code. Variants: ``prefill`` (prompts without history
   take torch SDPA, `attend.prompt_only`), ``prefill, kernel`` (the Triton kernel for them too, as
   before) and ``mixed`` (the same chunk plus ``--decodes`` running decodes of ``input_len`` context,
   eager: what a step of ``--enable-mixed-chunk`` carries while prompts wait).
2. **The offline engine** (`kvstrata.Engine`, one per ``--policy``): ``--prompts`` prompts of
   ``input_len`` random tokens submitted at once, ``--new`` tokens each (greedy, ``ignore_eos``),
   ``--chunk`` tokens of prefill per step; prefill tokens/s = every prompt token over the last
   request's time to first token, TTFT median and p99, and the whole run's time. ``prefill``: the
   default scheduling (prefill-only steps while prompts wait), ``mixed``: ``enable_mixed_chunk``.
   Decode steps run eager here (``disable_cuda_graph``: no capture time), as mixed steps always do.

``--defer-fill``: the engine runs' ``prefill_defer_fill`` values (comma-separated; 1 cuts prompts at
every step's end, as SGLang; the default 0.75 lets a prompt that would be cut wait for the next step).
``--profile-engine``: each engine run also in one profiler window (kernel time by kind over the whole
run). ``--geometry tiny --device cpu`` runs the same code on a small model on the CPU (a smoke test;
the torch attention backend, so the variants of part 1 are the same code there).
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from decode_step_gpu import GEOMETRIES, DecodeRequest, build_cache, fill, profile_steps, sync

from kvstrata.engine.attention import get_backend
from kvstrata.engine.config import ModelConfig
from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import LoadedModel, dummy_model
from kvstrata.engine.runner import StepRunner
from kvstrata.engine.scheduler import StepPlan
from kvstrata.engine.stats import RequestFinished
from kvstrata.radix.kernels import attend, extend, page_quantize


def compiled_variants() -> int:
    """Variants of the attention and page-quantize kernels compiled in this process so far (-1 when
    unknown, e.g. interpreted): each new specialization of their arguments compiles one."""
    total = 0
    kernels = (
        attend._attend_kernel,
        attend._extend_kernel,
        extend._flash_extend_kernel,
        attend._dequant_kernel,
        attend._merge_kernel,
        page_quantize._page_quantize_kernel,
    )
    for fn in kernels:
        caches = getattr(fn, "device_caches", None)
        if caches is None:
            return -1
        total += sum(len(c[0]) for c in caches.values())
    return total


def random_prompts(n: int, length: int, vocab: int, gen: torch.Generator) -> list[list[int]]:
    return torch.randint(10, vocab - 10, (n, length), generator=gen).tolist()


class PrefillStep:
    """One engine step over ``prompts`` fresh prompts of ``length`` tokens (and the running ``decodes``,
    one token each): admit, plan, run, sample; the prompts' sequences end without entering the tree."""

    def __init__(self, cache: Any, runner: StepRunner, prompts: int, length: int, decodes: list) -> None:
        self.cache, self.runner, self.decodes = cache, runner, decodes
        self.prompts, self.length = prompts, length
        self.gen = torch.Generator().manual_seed(1)

    @property
    def tokens(self) -> int:
        return self.prompts * self.length + len(self.decodes)

    def step(self) -> None:
        vocab = self.runner.net.config.vocab_size
        ids = random_prompts(self.prompts, self.length, vocab, self.gen)
        fresh = [DecodeRequest(self.cache.admit(p), p) for p in ids]
        reqs = [*self.decodes, *fresh]
        n_new = [1] * len(self.decodes) + [self.length] * len(fresh)
        batch = self.cache.begin_step([r.seq for r in reqs], n_new)
        sampled, out, _ = self.runner.run(StepPlan(reqs, n_new, batch))
        assert out is not None and len(sampled) == len(reqs)
        for req, tok in zip(sampled, out.tokens, strict=True):
            if req in self.decodes:
                req.output_ids.append(tok)
                req.seq.token_ids.append(tok)
        for req in fresh:
            self.cache.finish(req.seq, insert=False)


def time_steps(stepper: Any, steps: int, device: torch.device) -> float:
    """Median seconds of ``steps`` calls of ``stepper.step()`` after one warm-up, each synchronized."""
    stepper.step()
    sync(device)
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        stepper.step()
        sync(device)
        times.append(time.perf_counter() - t)
    return statistics.median(times)


class DenseForward:
    """The model's forward over ``prompts`` x ``length`` tokens with plain causal SDPA (flash on CUDA)
    and no cache (as `Transformer.dense_forward`); logits of the last position only, as the engine
    samples."""

    def __init__(self, net: Any, prompts: int, length: int) -> None:
        self.net = net
        dev = net.device
        gen = torch.Generator().manual_seed(2)
        ids = random_prompts(prompts, length, net.config.vocab_size, gen)
        self.ids = torch.tensor(ids, device=dev).view(-1)
        self.positions = torch.arange(length, device=dev).repeat(prompts)
        self.last = torch.arange(1, prompts + 1, device=dev) * length - 1
        shape = SimpleNamespace(batch=prompts, tokens=length)
        self.attn = lambda layer, q, k, v: attend.causal_sdpa(shape, q, k, v, net.config.attn_scale)
        self.tokens = prompts * length

    @torch.inference_mode()
    def step(self) -> None:
        self.net(self.ids, self.positions, attn=self.attn, logits_at=self.last)


def step_variants(net: Any, cfg: ModelConfig, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Part 1: the dense forward and the engine step variants, timed and profiled."""
    device = net.device
    prompts = max(1, args.chunk // args.input_len)
    rows = []
    dense = DenseForward(net, prompts, args.input_len)
    with torch.inference_mode():
        rows.append(measure("dense forward (SDPA causal, no cache)", dense, dense.tokens, args, device))
        del dense
        cache = build_cache(net, cfg, args.kv, args.decodes + prompts, args.input_len + 32)
        decodes = fill(cache, cfg, args.decodes, args.input_len, seed=0) if args.decodes else []
        backend = get_backend("triton" if device.type == "cuda" else "torch", cache, cfg.attn_scale)
        runner = StepRunner(net, cache, backend, device)
        variants = [
            ("engine step, prefill only", [], True),
            ("engine step, prefill only, kernel for fresh prompts", [], False),
            (f"engine step, mixed: + {args.decodes} decodes", decodes, True),
        ]
        real = attend.prompt_only
        for label, dec, sdpa in variants:
            if label.startswith("engine step, mixed") and not dec:
                continue
            attend.prompt_only = real if sdpa else (lambda g: False)
            try:
                stepper = PrefillStep(cache, runner, prompts, args.input_len, dec)
                rows.append(measure(label, stepper, prompts * args.input_len, args, device))
            finally:
                attend.prompt_only = real
        del runner, backend, cache, decodes
    if device.type == "cuda":
        torch.cuda.empty_cache()
    base = rows[0]["s_per_step"]
    for r in rows:
        r["vs_dense"] = base / r["s_per_step"]
    return rows


def measure(label: str, stepper: Any, prompt_tokens: int, args: argparse.Namespace, device) -> dict:
    s = time_steps(stepper, args.steps, device)
    prof = profile_steps(stepper, args.profile_steps, device) if args.profile_steps else {}
    row = {
        "what": label,
        "tokens_per_step": getattr(stepper, "tokens", prompt_tokens),
        "prompt_tokens_per_step": prompt_tokens,
        "s_per_step": s,
        "prompt_tokens_per_s": prompt_tokens / s,
        "profile": prof,
    }
    print(f"{label}: {1e3 * s:.1f} ms/step, {prompt_tokens / s:,.0f} prompt tokens/s", flush=True)
    return row


def engine_run(model: LoadedModel, policy: str, defer_fill: float, args: argparse.Namespace) -> dict:
    """Part 2: ``args.prompts`` prompts at once through the offline engine under ``policy``, prompts cut
    at a step's end only below ``defer_fill`` of the chunk (``prefill_defer_fill``)."""
    per_request = args.input_len + args.new
    # A shut-down engine sits in a reference cycle until a collection: free the previous run's KV pool
    # before this one sizes its own (a third 8B-sized run did not start without this).
    gc.collect()
    if model.net.device.type == "cuda":
        torch.cuda.empty_cache()
    engine = Engine(
        model=model,
        kv_cache_dtype=args.kv,
        kv_plan="off",
        max_running_requests=args.prompts,
        max_total_tokens=args.prompts * (per_request + 32),
        chunked_prefill_size=args.chunk,
        enable_mixed_chunk=policy == "mixed",
        prefill_defer_fill=defer_fill,
        disable_cuda_graph=True,
    )
    gen = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    params = {"temperature": 0, "max_new_tokens": args.new, "ignore_eos": True}
    try:
        # Warm-up: compiles what the run's shapes need (chunks with history, decodes) first.
        warm = max(2, args.chunk // args.input_len + 2)
        engine.generate(input_ids=random_prompts(warm, args.input_len, vocab, gen), sampling_params=params)
        events: list[RequestFinished] = []
        unsubscribe = engine.subscribe(lambda e: events.append(e) if isinstance(e, RequestFinished) else None)
        prompts = random_prompts(args.prompts, args.input_len, vocab, gen)
        compiled, steps = compiled_variants(), engine.get_stats().steps_total
        runs: list[tuple[float, list]] = []

        def run() -> None:
            t = time.perf_counter()
            outs = engine.generate(input_ids=prompts, sampling_params=params)
            runs.append((time.perf_counter() - t, outs))

        if args.profile_engine:
            # the whole run in one profiler window: kernel time by kind over every step it made
            prof = profile_steps(SimpleNamespace(step=run), 1, model.net.device)
        else:
            prof = {}
            run()
        ((total, outs),) = runs
        unsubscribe()
        steps = engine.get_stats().steps_total - steps
    finally:
        engine.shutdown()
    assert all(len(o["output_ids"]) == args.new for o in outs)
    ttft = sorted(e.ttft for e in events if e.ttft is not None)
    assert len(ttft) == args.prompts, len(ttft)
    row = {
        "policy": policy,
        "defer_fill": defer_fill,
        "prompts": args.prompts,
        "prompt_tokens": args.prompts * args.input_len,
        "prefill_tokens_per_s": args.prompts * args.input_len / ttft[-1],
        "median_ttft_s": statistics.median(ttft),
        "p99_ttft_s": ttft[min(len(ttft) - 1, int(0.99 * len(ttft)))],
        "last_ttft_s": ttft[-1],
        "total_s": total,
        "output_tokens_per_s": args.prompts * args.new / total,
        "steps": steps,
        "kernel_variants_compiled": compiled_variants() - compiled if compiled >= 0 else -1,
        "profile": prof,
    }
    print(f"engine {policy}, defer fill {defer_fill}: {json.dumps(row)}", flush=True)
    return row


def read_config(source: str | None, geometry: str) -> ModelConfig:
    if source is None:
        return ModelConfig.from_hf(GEOMETRIES[geometry])
    return ModelConfig.from_hf(Path(source))


def print_tables(steps: list[dict], engines: list[dict], args: argparse.Namespace, where: str) -> None:
    print(
        f"\nprefill, {args.input_len}-token prompts, chunk {args.chunk}, history {args.kv}; {where}, "
        f"torch {torch.__version__}\n"
    )
    print("| what | tokens/step | ms/step | prompt tokens/s | vs dense | GPU busy ms | idle ms |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in steps:
        p = r["profile"]
        print(
            f"| {r['what']} | {r['tokens_per_step']:,} | {1e3 * r['s_per_step']:.1f} "
            f"| {r['prompt_tokens_per_s']:,.0f} | {r['vs_dense']:.2f}x "
            f"| {p.get('busy_ms_per_step', float('nan')):.1f} "
            f"| {p.get('idle_ms_per_step', float('nan')):.1f} |"
        )
    if engines:
        print(
            f"\noffline engine: {args.prompts} prompts x {args.input_len} tokens at once, {args.new} new "
            "tokens each (greedy), decode eager\n"
        )
        print(
            "| policy | defer fill | prefill tokens/s | median TTFT s | p99 TTFT s | last TTFT s | total s "
            "| steps | kernels compiled |"
        )
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in engines:
            print(
                f"| {r['policy']} | {r['defer_fill']} | {r['prefill_tokens_per_s']:,.0f} "
                f"| {r['median_ttft_s']:.2f} "
                f"| {r['p99_ttft_s']:.2f} | {r['last_ttft_s']:.2f} | {r['total_s']:.2f} | {r['steps']} "
                f"| {r['kernel_variants_compiled']} |"
            )
    profiled = [(r["what"], r["profile"], "ms/step") for r in steps]
    profiled += [
        (f"engine {r['policy']}, defer fill {r['defer_fill']}, whole run", r.get("profile"), "ms in all")
        for r in engines
    ]
    for what, p, unit in profiled:
        if not p:
            continue
        kinds = ", ".join(f"{k} {v:.1f}" for k, v in p.get("kernel_ms_per_step_by_kind", {}).items())
        busy, idle = p["busy_ms_per_step"], p["idle_ms_per_step"]
        print(f"\n{what}: kernel {unit} by kind: {kinds}; GPU busy {busy:.1f}, idle {idle:.1f}")
        for name, ms in p.get("top_kernels_ms_per_step", {}).items():
            print(f"    {ms:8.2f} ms  {name}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default=None, help="model directory or config.json (default: --geometry)")
    ap.add_argument("--geometry", default="llama3-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--kv", default="auto", help="history codec")
    ap.add_argument("--input-len", type=int, default=1536)
    ap.add_argument("--chunk", type=int, default=8192, help="prefill tokens per step (chunked_prefill_size)")
    ap.add_argument("--decodes", type=int, default=250, help="running decodes of the mixed step variant")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per variant (after one warm-up)")
    ap.add_argument("--profile-steps", type=int, default=1)
    ap.add_argument("--prompts", type=int, default=128, help="prompts of the engine runs")
    ap.add_argument("--new", type=int, default=16, help="tokens generated per prompt in the engine runs")
    ap.add_argument("--policy", default="prefill,mixed", help="engine runs: prefill, mixed (empty: none)")
    ap.add_argument(
        "--defer-fill",
        default="0.75",
        help="engine runs: prefill_defer_fill values, comma-separated (1: prompts always cut, as SGLang)",
    )
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--profile-engine", action="store_true", help="profile each engine run's kernels (CUDA, one window)"
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    cfg = read_config(args.config, args.geometry)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    net = dummy_model(cfg, dtype, device, seed=0)
    where = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    steps = step_variants(net, cfg, args)
    model = LoadedModel(net=net, config=cfg, tokenizer=None, name="dummy", path=Path(args.config or "dummy"))
    fills = [float(f) for f in args.defer_fill.split(",")]
    engines = [engine_run(model, p, f, args) for p in args.policy.split(",") if p for f in fills]
    print_tables(steps, engines, args, where)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": where, "args": vars(args), "steps": steps, "engines": engines}, f, indent=1)


if __name__ == "__main__":
    main()
