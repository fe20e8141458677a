"""Host time of one decode step of the SGLang plugin at a large batch, on CPU (no GPU, no kernels).

What SGLang's decode CUDA-graph replay asks of the plugin on the host every step
(``init_forward_metadata_out_graph``: ring bookkeeping of every request row and the step's plan
copied into the graph's static inputs), against the baseline of the same batch planned as an eager
step (``init_forward_metadata``: `RingBook.plan` + kvstrata's `build_step`), in the same run. Each
step continues every request by one token (pages complete every ``--page-size`` steps); medians
over ``--steps`` steps, after a warm-up. Runs in the SGLang test environment:

    PYTHONPATH=$PWD .venv-sglang/bin/python benchmarks/sglang_host_step.py [--batch 256]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from types import SimpleNamespace

import torch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=400)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--prefix", type=int, default=1536, help="tokens of each request before the steps")
    args = parser.parse_args()
    torch.set_num_threads(1)
    importlib.import_module("tests.integrations.sglang.conftest")  # sglang's torchvision imports on CPU

    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.model_executor.forward_batch_info import ForwardMode

    from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend
    from kvstrata.integrations.sglang.kernels import TorchStrataKernels, TritonStrataKernels
    from kvstrata.integrations.sglang.options import PluginOptions
    from kvstrata.integrations.sglang.pool import pool_class
    from tests.integrations.sglang.conftest import alloc_row

    B, P = args.batch, args.page_size
    context = args.prefix + args.steps + 2 * P
    rows_total = 2 * B + 1  # one set of rows for each path, row 0 for padding
    req_pool = ReqToTokenPool(
        size=rows_total, max_context_len=context, device="cpu", enable_memory_saver=False
    )
    pool = pool_class(PluginOptions(codec="fp8_e4m3", recent_window=args.window))(
        size=rows_total * context,
        page_size=P,
        dtype=torch.bfloat16,
        head_num=1,
        head_dim=16,
        layer_num=1,
        device="cpu",
        enable_memory_saver=False,
    )
    runner = SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_pool)

    class HostOnly(TritonStrataKernels):
        """The Triton kernels' graph contract; nothing here launches a kernel."""

        def __init__(self) -> None:
            TorchStrataKernels.__init__(self)

    backend = KvstrataAttnBackend(runner, HostOnly())
    backend.init_cuda_graph_state(B, B)
    all_rows = [alloc_row(req_pool) for _ in range(2 * B)]
    for row in all_rows:
        req_pool.req_to_token[row] = torch.arange(row * context, (row + 1) * context, dtype=torch.int32)
    paths = {
        "graph": (all_rows[:B], backend.init_forward_metadata_out_graph),
        "eager": (all_rows[B:], backend.init_forward_metadata),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    warmup = 20
    for i in range(warmup + args.steps):
        for name, (rows, plan) in paths.items():
            seq = torch.full((B,), args.prefix + i + 1, dtype=torch.long)
            batch = SimpleNamespace(
                forward_mode=ForwardMode.DECODE,
                batch_size=B,
                req_pool_indices=torch.tensor(rows),
                seq_lens=seq,
                seq_lens_cpu=seq,
            )
            t = time.perf_counter()
            plan(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    graph_us = statistics.median(times["graph"]) * 1e6
    eager_us = statistics.median(times["eager"]) * 1e6
    print(
        f"decode step of {B} requests, page size {P}, window {args.window}: host time, median of {args.steps}"
    )
    print(f"  graph replay (init_forward_metadata_out_graph): {graph_us:8.0f} us")
    print(f"  eager plan   (init_forward_metadata, baseline): {eager_us:8.0f} us")
    print(f"  ratio graph / eager: {graph_us / eager_us:.3f}")


if __name__ == "__main__":
    main()
