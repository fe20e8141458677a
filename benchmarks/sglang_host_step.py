"""Host time of one decode step of the SGLang plugin at a large batch, on CPU (no GPU, no kernels).

What SGLang asks of the plugin on the host before every decode step, for three paths, each on its own
pool and request rows, in the same run:

- graph replay (``init_forward_metadata_out_graph``): request rows from the request ids, ring
  bookkeeping of every row, the plan copied into the graph's static inputs;
- eager decode (``init_forward_metadata`` with the Triton kernels: a batch larger than the largest
  captured graph, or ``--disable-cuda-graph``): the same plan, then the device gathers of page tables
  and ring rows, which here run on the CPU (on a GPU they are kernel launches);
- the baseline: the same batch planned as a kvstrata `StepBatch` (``init_forward_metadata`` with the
  torch kernels: `RingBook.plan` + `build_step`), which eager decode steps used before.

Each step continues every request by one token (pages complete every ``--page-size`` steps); medians
over ``--steps`` steps, after a warm-up. On CPU a device-to-host copy costs nothing, so this measures
the host work only, not the wait a copy from a GPU adds. Runs in the SGLang test environment:

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

    class HostOnly(TritonStrataKernels):
        """The Triton kernels' graph contract; nothing here launches a kernel."""

        def __init__(self) -> None:
            TorchStrataKernels.__init__(self)

    def backend_with(kernels) -> tuple[KvstrataAttnBackend, list[int], list[str]]:
        """A backend over a pool of its own, with ``B`` requests whose extend steps have run."""
        req_pool = ReqToTokenPool(
            size=B + 1, max_context_len=context, device="cpu", enable_memory_saver=False
        )
        pool = pool_class(PluginOptions(codec="fp8_e4m3", recent_window=args.window))(
            size=(B + 1) * context,
            page_size=P,
            dtype=torch.bfloat16,
            head_num=1,
            head_dim=16,
            layer_num=1,
            device="cpu",
            enable_memory_saver=False,
        )
        backend = KvstrataAttnBackend(
            SimpleNamespace(token_to_kv_pool=pool, req_to_token_pool=req_pool), kernels
        )
        rows = [alloc_row(req_pool) for _ in range(B)]
        for row in rows:
            req_pool.req_to_token[row] = torch.arange(row * context, (row + 1) * context, dtype=torch.int32)
        rids = [f"request-{row}" for row in rows]
        backend.requests.record(rids, rows)
        return backend, rows, rids

    graph, graph_rows, graph_rids = backend_with(HostOnly())
    graph.init_cuda_graph_state(B, B)
    eager, eager_rows, eager_rids = backend_with(HostOnly())
    base, base_rows, base_rids = backend_with(TorchStrataKernels())
    paths = {
        "graph": (graph_rows, graph_rids, graph.init_forward_metadata_out_graph),
        "eager": (eager_rows, eager_rids, eager.init_forward_metadata),
        "base": (base_rows, base_rids, base.init_forward_metadata),
    }
    times: dict[str, list[float]] = {name: [] for name in paths}
    warmup = 20
    for i in range(warmup + args.steps):
        for name, (rows, rids, plan) in paths.items():
            seq = torch.full((B,), args.prefix + i + 1, dtype=torch.long)
            batch = SimpleNamespace(
                forward_mode=ForwardMode.DECODE,
                batch_size=B,
                rids=rids,
                req_pool_indices=torch.tensor(rows),
                seq_lens=seq,
                seq_lens_cpu=seq,
            )
            t = time.perf_counter()
            plan(batch)
            if i >= warmup:
                times[name].append(time.perf_counter() - t)
    us = {name: statistics.median(t) * 1e6 for name, t in times.items()}
    print(
        f"decode step of {B} requests, page size {P}, window {args.window}: host time, median of {args.steps}"
    )
    print(f"  graph replay (init_forward_metadata_out_graph):          {us['graph']:8.0f} us")
    print(f"  eager decode (init_forward_metadata, Triton kernels):    {us['eager']:8.0f} us")
    print(f"  StepBatch plan (init_forward_metadata, torch; baseline): {us['base']:8.0f} us")
    print(f"  ratio graph / baseline: {us['graph'] / us['base']:.3f}")
    print(f"  ratio eager / baseline: {us['eager'] / us['base']:.3f}")


if __name__ == "__main__":
    main()
