"""The prefill matmuls of one layer on one GPU: time a token and the cuBLAS kernel picked, by row count.

    python benchmarks/matmul_gpu.py [--config .sgl/model] [--tokens 7680,8192,16384] \
        [--libs cublas,cublaslt] [--repeats 20]

A prefill step is ``tokens`` rows through the layer's four products (q/k/v, output, gate/up, down;
random BF16 weights of the model's geometry, ``--config`` a model directory or ``config.json``, the
8B geometry by default). For each row count and each cuBLAS library PyTorch can prefer
(`torch.backends.cuda.preferred_blas_library`), and for the same rows as two products of half the
rows each ("halves"), it prints the median time of the four products, microseconds a token for the
whole model (times its layers), TFLOP/s, and the kernel each product ran (one profiled call).
``--split-k 2,4`` adds, for each row count, the four products split along their inputs by hand
(`split_k_linear`: one batched product of S chunks, float32 out, then their sum): cuBLAS's split-K kernel
for the decode step's down product, which SGLang's step on one H200 ran and ours on the H100 did not. The
baseline is the first library at the first row count, measured in the same run. Configurations are
timed in interleaved rounds after ``--warm-s`` seconds of untimed rounds (`time_round_robin`).
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from decode_step_gpu import GEOMETRIES
from torch.nn import functional as F

from kvstrata.engine.config import ModelConfig
from kvstrata.engine.model import split_k_linear


def layer_shapes(cfg: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of a layer's four products, fused as the engine runs them."""
    q, kv = cfg.q_heads * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    return {
        "qkv": (cfg.hidden_size, q + 2 * kv),
        "o": (q, cfg.hidden_size),
        "gate_up": (cfg.hidden_size, 2 * cfg.intermediate_size),
        "down": (cfg.intermediate_size, cfg.hidden_size),
    }


def products(weights: dict[str, torch.Tensor], rows: int, halves: bool, split_k: int = 1) -> list:
    """Closures running each product on ``rows`` rows (as one product, two of half the rows, or split
    along the input features: `split_k_linear`)."""
    runs = []
    for w in weights.values():
        x = torch.randn(rows, w.shape[1], device=w.device, dtype=w.dtype)
        if split_k > 1:

            def run(x=x, w=w) -> None:
                split_k_linear(x, w, split_k)
        elif halves:
            h = rows // 2
            y = torch.empty(rows, w.shape[0], device=w.device, dtype=w.dtype)

            def run(x=x, y=y, w=w, h=h) -> None:
                torch.mm(x[:h], w.t(), out=y[:h])
                torch.mm(x[h:], w.t(), out=y[h:])
        else:

            def run(x=x, w=w) -> None:
                F.linear(x, w)

        runs.append(run)
    return runs


def time_round_robin(
    configs: list[tuple[str, list]], repeats: int, warm_s: float, inner: int = 5
) -> list[list[list[float]]]:
    """ms of each product of each configuration, ``repeats`` rounds that visit every configuration in
    turn (its library preferred while it runs), after ``warm_s`` seconds of the same rounds untimed: the
    GPU's clocks settle under sustained matrix work, and a configuration timed in one block after
    another would carry that drift into its ratio. A sample is ``inner`` back-to-back calls between two
    events, queued behind one more call, so that the GPU is busy when the first event fires and no
    host launch time falls inside the window."""
    times: list[list[list[float]]] = [[[] for _ in runs] for _, runs in configs]
    previous = torch.backends.cuda.preferred_blas_library()
    start_warm = time.perf_counter()
    timed = False
    try:
        while not timed or len(times[0][0]) < repeats:
            timed = time.perf_counter() - start_warm >= warm_s
            for c, (lib, runs) in enumerate(configs):
                torch.backends.cuda.preferred_blas_library(lib)
                for i, run in enumerate(runs):
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    run()
                    start.record()
                    for _ in range(inner):
                        run()
                    end.record()
                    end.synchronize()
                    if timed:
                        times[c][i].append(start.elapsed_time(end) / inner)
    finally:
        torch.backends.cuda.preferred_blas_library(previous)
    return times


def kernel_names(runs: list) -> list[str]:
    """The GPU kernels of one call of each product (profiled)."""
    names = []
    for run in runs:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        names.append("+".join(sorted(set(kernels))) or "?")
    return names


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=None, help="model directory or config.json (default: 8B geometry)")
    ap.add_argument("--tokens", default="7680,8192,16384", help="row counts (prefill tokens a step)")
    ap.add_argument("--libs", default="cublas,cublaslt", help="cuBLAS libraries PyTorch may prefer")
    ap.add_argument("--no-halves", action="store_true", help="skip the two-half-products variant")
    ap.add_argument("--split-k", default="", help="also the products split by hand into S chunks, e.g. 2,4")
    ap.add_argument("--repeats", type=int, default=20, help="timed rounds over all configurations (>= 1)")
    ap.add_argument("--warm-s", type=float, default=10.0, help="seconds of untimed rounds first")
    args = ap.parse_args()
    cfg = ModelConfig.from_hf(args.config or GEOMETRIES["llama3-8b"])
    dev = torch.device("cuda")
    torch.manual_seed(0)
    weights = {
        name: torch.randn(n_out, n_in, device=dev, dtype=torch.bfloat16) * 0.02
        for name, (n_in, n_out) in layer_shapes(cfg).items()
    }
    flops_token = 2 * sum(w.numel() for w in weights.values())
    print(f"# {torch.cuda.get_device_name()}, torch {torch.__version__}; layer products {list(weights)}")
    libs = args.libs.split(",")
    labels, configs = [], []
    for rows in (int(t) for t in args.tokens.split(",")):
        for lib, halves in [(lib, False) for lib in libs] + ([] if args.no_halves else [(libs[0], True)]):
            labels.append((rows, f"{lib}{', halves' if halves else ''}"))
            configs.append((lib, products(weights, rows, halves)))
        for splits in (int(s) for s in args.split_k.split(",") if s):
            labels.append((rows, f"{libs[0]}, split-K {splits} by hand"))
            configs.append((libs[0], products(weights, rows, False, splits)))
    times = time_round_robin(configs, args.repeats, args.warm_s)
    rows_out = []
    base = None
    previous = torch.backends.cuda.preferred_blas_library()
    for (rows, label), (lib, runs), each_times in zip(labels, configs, times, strict=True):
        torch.backends.cuda.preferred_blas_library(lib)
        names = kernel_names(runs)
        each = [statistics.median(t) for t in each_times]
        ms = sum(each)
        us_token = ms * 1e3 / rows * cfg.num_layers
        base = base or us_token
        tflops = flops_token * rows / (ms * 1e-3) / 1e12
        rows_out.append((rows, label, ms, us_token, tflops, base / us_token, each, names))
    torch.backends.cuda.preferred_blas_library(previous)
    print("\n| tokens | library | ms a layer | us a token | TFLOP/s | vs first | ms qkv/o/gate_up/down |")
    print("|---:|---|---:|---:|---:|---:|---|")
    for rows, label, ms, us_token, tflops, ratio, each, _ in rows_out:
        ms_each = " / ".join(f"{m:.3f}" for m in each)
        print(f"| {rows} | {label} | {ms:.3f} | {us_token:.2f} | {tflops:.0f} | {ratio:.3f}x | {ms_each} |")
    print("\nkernels (qkv | o | gate_up | down):")
    for rows, label, *_, names in rows_out:
        print(f"  {rows} {label}: " + " | ".join(n[:70] for n in names))


if __name__ == "__main__":
    main()
