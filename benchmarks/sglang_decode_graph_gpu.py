"""The SGLang plugin's decode step as a captured CUDA graph, at the serving shape, without a server.

    PYTHONPATH=/tmp/sglsite:$PWD python benchmarks/sglang_decode_graph_gpu.py \
        [--batch 256] [--prefix 1792] [--layers 32] [--codecs fp8_e4m3,fp4_e2m1] [--steps 48] \
        [--max-context 8196,0] [--profile FILE]

What SGLang's decode graph runner does with ``--attention-backend kvstrata``, on the plugin's own pool
(`StratifiedTokenToKVPool`, Llama-3-8B KV geometry: 8 KV heads of 128, 32 query heads, BF16 ring of
``--window`` + page size tokens) and SGLang's ``ReqToTokenPool``: ``init_cuda_graph_state``, a capture
of one decode forward of ``--layers`` attention layers (per layer `forward_decode`: the Triton attend
and store; q, k and v are views of one fused QKV output, as SGLang's Llama passes them) for
``--batch`` entries, then per step ``init_forward_metadata_out_graph`` (the host plan and its copy) and
a replay. Every request starts at ``--prefix`` tokens (cold pages whose codes are whatever the pool
holds: timing only) and all advance together, as the served benchmark's requests of equal length do,
so every entry completes a page in one step of page_size; ``--window`` + page_size warm-up steps fill
the rings first.

``--max-context``: the request rows' widths to run, each a run of its own. The graph's page table is
as wide as SGLang's ``ReqToTokenPool`` (the model's context + 4: 8,196 when served, 513 columns), and
the attention's split-KV rule reads that width: at 256 entries it splits the history in 2 either way,
but at 513 columns the split boundary (page 257) lies past every request's cold pages, at the run's
own width (0) inside them. The table prints each launch's ``splits x pages a split``.

Timed with CUDA events around the copy and the replay (the GPU's time; SGLang overlaps the host
plan with the previous step), median over ``--steps`` steps, for each codec:

- ``step``: the decode step as served now (entries that complete no page skip the page quantize);
- ``step, page 0 rewritten`` (the baseline of the same graph): every entry that completes no page
  quantizes the null ring row into page 0, as the plugin's graphs did before (`graph.NO_PAGE` set to 0
  in the captured tensor), alternated with ``step`` in blocks of page_size steps;
- ``attend only``: a second graph of the same step without the store (``save_kv_cache=False``);
- ``SDPA BF16``: torch SDPA over the same batch with dense BF16 K/V of the same lengths (one layer's
  tensors, run ``--layers`` times), the dense baseline at this shape.

``--profile FILE``: a kernel table (torch profiler, `decode_step_gpu.profile_steps`) of a page cycle
of replays of ``step`` for each run, written to FILE (markdown).

``--device cpu`` runs the same code eagerly on tiny shapes under ``TRITON_INTERPRET=1`` (a smoke test;
the times mean nothing there).
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

# SGLang's ReqToTokenPool width for the served model: its context length (8,192) + 4. The decode graph's
# page table is that wide, and the attention kernel's split-KV rule reads the table's width.
SERVED_CONTEXT = 8196


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument(
        "--prefix", type=int, default=1792, help="tokens of each request (a multiple of the page)"
    )
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--q-heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--window", type=int, default=128)
    parser.add_argument("--codecs", default="fp8_e4m3,fp4_e2m1")
    parser.add_argument("--steps", type=int, default=48)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--max-context",
        default=f"{SERVED_CONTEXT},0",
        help="request-row widths (SGLang's max_context_len) to run, comma separated; 0: as wide as the "
        f"run needs. Default: the served one ({SERVED_CONTEXT}, the Llama-3-8B config's 8,192 + 4), then 0",
    )
    parser.add_argument(
        "--profile", default=None, help="write a kernel table (markdown) of a page cycle of steps here"
    )
    return parser.parse_args()


class DecodeWorld:
    """One codec's pool, request rows and backend, its decode graphs, and the batch's state."""

    def __init__(self, args: argparse.Namespace, codec: str, max_context: int) -> None:
        from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

        from kvstrata.integrations.sglang.attention_backend import KvstrataAttnBackend
        from kvstrata.integrations.sglang.kernels import TritonStrataKernels
        from kvstrata.integrations.sglang.options import PluginOptions
        from kvstrata.integrations.sglang.pool import pool_class
        from tests.integrations.sglang.conftest import alloc_row

        B, P, dev = args.batch, args.page_size, torch.device(args.device)
        self.args, self.device = args, dev
        self.context = args.prefix + total_steps(args) + 2 * P  # the slots a request uses
        self.width = max(max_context, self.context)
        req_pool = ReqToTokenPool(
            size=B + 1, max_context_len=self.width, device=dev, enable_memory_saver=False
        )
        self.rows = [alloc_row(req_pool) for _ in range(B)]
        self.pool = pool_class(PluginOptions(codec=codec, recent_window=args.window))(
            size=(max(self.rows) + 1) * self.context,
            page_size=P,
            dtype=torch.bfloat16,
            head_num=args.kv_heads,
            head_dim=args.head_dim,
            layer_num=args.layers,
            device=dev,
            enable_memory_saver=False,
        )
        runner = SimpleNamespace(token_to_kv_pool=self.pool, req_to_token_pool=req_pool)
        self.backend = KvstrataAttnBackend(runner, TritonStrataKernels())
        span = torch.arange(self.context, dtype=torch.int32, device=dev)
        for row in self.rows:  # row r owns slots r * context ..; page 0 stays SGLang's padding page
            req_pool.req_to_token[row, : self.context] = span + row * self.context
        self.rids = [f"request-{row}" for row in self.rows]
        self.backend.requests.record(self.rids, self.rows)
        self.lengths = torch.full((B,), args.prefix, dtype=torch.long)
        gen = torch.Generator(device=dev).manual_seed(0)
        H, Hq, D = args.kv_heads, args.q_heads, args.head_dim
        # q, k, v as SGLang's Llama passes them: views of one fused QKV projection output
        qkv = torch.randn(B, (Hq + 2 * H) * D, generator=gen, device=dev).to(torch.bfloat16)
        self.q, self.k, self.v = qkv.split([Hq * D, H * D, H * D], dim=1)
        self.layers = [
            SimpleNamespace(tp_q_head_num=Hq, tp_k_head_num=H, head_dim=D, layer_id=i, scaling=D**-0.5)
            for i in range(args.layers)
        ]
        self.backend.init_cuda_graph_state(max_bs=B, max_num_tokens=B)

    def batch(self, in_capture: bool = False) -> SimpleNamespace:
        """SGLang's decode batch of the requests at their current lengths (a capture's: padding only)."""
        from sglang.srt.model_executor.forward_batch_info import ForwardMode

        B, dev = self.args.batch, self.device
        seq = torch.ones(B, dtype=torch.long) if in_capture else self.lengths + 1
        rows = torch.zeros(B, dtype=torch.long) if in_capture else torch.tensor(self.rows)
        slots = (rows * self.context + seq - 1) * (0 if in_capture else 1)
        return SimpleNamespace(
            forward_mode=ForwardMode.DECODE,
            batch_size=B,
            rids=None if in_capture else self.rids,
            req_pool_indices=rows.to(dev),
            seq_lens=seq.to(dev),
            seq_lens_cpu=seq,
            out_cache_loc=slots.to(dev),
        )

    def forward(self, fb, store: bool) -> None:
        """The graph's body: the device gathers, then every layer's attention (and store)."""
        self.backend.init_forward_metadata_in_graph(fb)
        for layer in self.layers:
            self.backend.forward_decode(self.q, self.k, self.v, layer, fb, save_kv_cache=store)

    def capture(self, store: bool) -> Callable[[], None]:
        """A step of the batch as a replay: plan, copy, graph (eagerly on CPU); the rings advance."""
        fb = self.batch(in_capture=True)
        self.backend.init_forward_metadata_out_graph(fb, in_capture=True)
        self.forward(fb, store)  # SGLang's warm-up run before its capture
        graph = None
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                self.forward(fb, store)

        def step() -> None:
            live = self.batch()
            self.backend.init_forward_metadata_out_graph(live)
            if graph is None:
                self.forward(live, store)
            else:
                graph.replay()
            self.lengths += 1

        return step


def total_steps(args: argparse.Namespace) -> int:
    """Decode steps one run takes: the rings' warm-up, the alternated blocks, a page cycle for the
    profile, attend only."""
    P = args.page_size
    return args.window + 2 * P + 2 * P * -(-args.steps // P) + args.steps + 2


def timed(step: Callable[[], None], n: int, device: torch.device) -> list[float]:
    """Milliseconds of each of ``n`` steps: CUDA events on the GPU (its time), wall time on the CPU."""
    if device.type != "cuda":
        times = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            times.append((time.perf_counter() - t) * 1e3)
        return times
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(n)]
    for start, end in events:
        start.record()
        step()
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) for start, end in events]


def sdpa_bf16(w: DecodeWorld) -> Callable[[], None]:
    """Dense BF16 decode attention over the batch's lengths (padded to the longest, masked)."""
    a, dev = w.args, w.device
    B, H, Hq, D = a.batch, a.kv_heads, a.q_heads, a.head_dim
    T = int(w.lengths.max()) + 1
    k = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, H, T, D, device=dev, dtype=torch.bfloat16)
    q = torch.randn(B, Hq, 1, D, device=dev, dtype=torch.bfloat16)
    mask = (torch.arange(T, device=dev).view(1, T) <= w.lengths.to(dev).view(B, 1)).view(B, 1, 1, T)

    def step() -> None:
        for _ in range(a.layers):
            torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)

    return step


def run_codec(args: argparse.Namespace, codec: str, max_context: int) -> dict[str, Any]:
    """Median ms per step of the table's columns for one codec and request-row width, the attention
    launch's split-KV shape, and (``--profile``) the kernel profile of a page cycle of steps."""
    from kvstrata.integrations.sglang.graph import NO_PAGE

    P, n = args.page_size, args.steps
    w = DecodeWorld(args, codec, max_context)
    step = w.capture(store=True)
    assert w.backend.graph is not None
    no_page = w.backend.graph.no_page
    timed(step, args.window + P, w.device)  # the rings fill; compiles, caches
    now: list[float] = []
    base: list[float] = []
    for block in range(2 * -(-n // P)):  # alternate blocks of P steps (each one page cycle)
        no_page.fill_(0 if block % 2 else NO_PAGE)
        (base if block % 2 else now).extend(timed(step, P, w.device))
    no_page.fill_(NO_PAGE)
    prof = profile_replays(step, P, w.device) if args.profile else None
    shape = split_shape(w)
    only = timed(w.capture(store=False), n + 2, w.device)[2:]
    sdpa = timed(sdpa_bf16(w), n + 2, w.device)[2:]
    med = {k: statistics.median(v) for k, v in (("now", now), ("base", base), ("only", only), ("sdpa", sdpa))}
    return {**med, "columns": w.backend.graph.width, "split": shape, "profile": prof}


def split_shape(w: DecodeWorld) -> str:
    """``splits x pages a split`` of the captured step's attention launch (its `attend.PassLaunch`)."""
    from kvstrata.radix.kernels import attend

    assert w.backend.graph is not None
    launches = attend._STEP_LAUNCHES.get(w.backend.graph.step_for(w.args.batch), {})
    # PassLaunch.scalars ends with (page-table stride, ring-row stride, pages a split, splits, tail split)
    return ", ".join(f"{launch.splits} x {launch.scalars[-3]}" for launch in launches.values())


def profile_replays(step: Callable[[], None], steps: int, device: torch.device) -> dict[str, Any]:
    """`decode_step_gpu.profile_steps` over ``steps`` replays: kernel time by kind and name."""
    sys.path.insert(0, str(Path(__file__).parent))
    from decode_step_gpu import profile_steps

    return profile_steps(SimpleNamespace(step=step, settle=lambda: None), steps, device)


def profile_markdown(title: str, prof: dict[str, Any]) -> str:
    """The kernel table of one run: kernel time by kind and the top kernels, per step."""
    if not prof:
        return f"#### {title}: no profile\n"
    wall = prof["wall_ms_per_step"]
    lines = [
        f"#### {title}: {prof['kernels_per_step']:.0f} kernels a step, wall {wall:.3f} ms, "
        f"kernels busy {prof['busy_ms_per_step']:.3f} ms",
        "",
        "| kind | ms/step | share of wall |",
        "|---|---:|---:|",
    ]
    kinds = prof["kernel_ms_per_step_by_kind"].items()
    lines += [f"| {kind} | {ms:.3f} | {100 * ms / wall:.1f}% |" for kind, ms in kinds]
    lines += ["", "| top kernels | ms/step |", "|---|---:|"]
    lines += [f"| `{name}` | {ms:.3f} |" for name, ms in prof["top_kernels_ms_per_step"].items()]
    return "\n".join(lines) + "\n\n"


def main() -> None:
    args = parse_args()
    if args.prefix % args.page_size:
        raise SystemExit(f"--prefix {args.prefix} is not a multiple of --page-size {args.page_size}")
    importlib.import_module("tests.integrations.sglang.conftest")  # sglang's torchvision imports on CPU
    print(
        f"SGLang plugin decode graph: batch {args.batch}, {args.prefix} tokens a request at the start, "
        f"{args.layers} layers, {args.q_heads}/{args.kv_heads} heads of {args.head_dim}, "
        f"page {args.page_size}, window {args.window}; ms per step, median of {args.steps} "
        "(GPU time: the plan's copy and the replay)"
    )
    print(
        "| codec | page-table columns | attention splits x pages | step | step, page 0 rewritten "
        "(baseline) | step / baseline | attend only | SDPA BF16 |"
    )
    print("|---|---:|---|---:|---:|---:|---:|---:|")
    profiles = []
    for codec in args.codecs.split(","):
        for max_context in (int(c) for c in args.max_context.split(",")):
            r = run_codec(args, codec, max_context)
            print(
                f"| {codec} | {r['columns']} | {r['split']} | {r['now']:.3f} | {r['base']:.3f} "
                f"| {r['now'] / r['base']:.3f} | {r['only']:.3f} | {r['sdpa']:.3f} |",
                flush=True,
            )
            if r["profile"] is not None:
                profiles.append(profile_markdown(f"{codec}, {r['columns']} columns", r["profile"]))
            if args.device == "cuda":
                torch.cuda.empty_cache()
    if args.profile:
        Path(args.profile).write_text("".join(profiles))


if __name__ == "__main__":
    main()
