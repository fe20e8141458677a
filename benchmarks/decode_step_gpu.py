"""One decode step at large batch on one GPU: time per step against the bytes it must read, and a profile.

    python benchmarks/decode_step_gpu.py [--batch 256] [--context 2048] [--kv auto,fp8_e4m3] [--steps 40]

Llama-3-8B geometry with random BF16 weights (`--load-format dummy`'s `dummy_model`: nothing is read or
downloaded). For each history codec (``auto``: BF16, no quantization; ``fp8_e4m3``: the shipped default,
a BF16 ring of 128 tokens and sinks), ``--batch`` sequences of ``--context`` random tokens are put in a
real `StratifiedKVCache` by one planned step whose K/V (random, seeded) go through the cache's own store,
so pool, ring and sinks hold what a prefill would leave there (non-zero codes). Then the engine's decode
step runs as the engine runs it: ``cache.begin_step`` (the plan), `StepRunner.run` (CUDA graphs of the
dense parts captured for the batch size, Triton attention and page quantize between them, the GPU
sampler with its one host read), greedy tokens appended.

Printed per codec: median ms/step over ``--steps`` steps after ``--warmup``; the bytes floor
(weights read once: every parameter but the input embedding, plus the K/V the step's plan reads: cold
pages with their scales, ring rows, sink pages) over the HBM bandwidth measured in the same run (a
device-to-device copy, bytes read + written); the ratio; the host time of ``begin_step``; and a
torch.profiler summary of ``--profile-steps`` steps: kernel-busy time (the union of kernel intervals)
against the steps' wall time, the idle rest, and the kernels by share. A checksum of every greedy token
lets two versions of the code be compared for token-for-token equality on the same machine.

``--plan table,lists`` runs every codec twice in one process: with the cache's device page table
(`SlotPageTable`, the CUDA default: page tables and ring rows gathered on the device) and with them
built from the sequences' lists every step (the CPU default), for the host time of ``begin_step``.

``--dense torch,fused`` runs every codec with the dense half as the torch code (``fused.MODE = "off"``:
RMSNorm, RoPE, SiLU*mul and residual adds as separate torch kernels) and with the fused Triton kernels
of `kvstrata.engine.fused` (the CUDA default), one after the other in one process, so the two are
measured on the same machine in one call. ``--profile FILE`` writes the profile of every run as
markdown tables: kernel time per step by kind against the step's wall time (the rest is the GPU
waiting on the host: launches, the plan, the sampler's read), and the top kernels; the matmul row
also gives the rate the matmuls ran at (FLOP/s of ``2 x batch x weights`` and weight bytes/s).

``--graph piecewise,full`` runs every codec with the piecewise decode graphs (attention launched eagerly
between 33 dense graphs; the engine's default) and with the whole step in one graph
(`kvstrata.engine.full_graph`, ``--cuda-graph-mode full``), one after the other in one process (on the
CPU neither captures: both rows run the step without graphs).

``--blas-library cublaslt`` has PyTorch prefer cuBLASLt for the matmuls (``cublas``: cuBLAS), for the
whole process; run each in its own process to compare them.

``--geometry tiny --device cpu`` runs the same code on a small model on the CPU (a smoke test).
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import statistics
import time
from typing import Any

import torch

from kvstrata.engine import fused
from kvstrata.engine.attention import get_backend
from kvstrata.engine.config import ModelConfig
from kvstrata.engine.cuda_graph import DecodeGraphs
from kvstrata.engine.full_graph import FullDecodeGraphs
from kvstrata.engine.loader import dummy_model
from kvstrata.engine.model import split_k_chunk
from kvstrata.engine.options import EngineArgs
from kvstrata.engine.runner import Launched, StepRunner
from kvstrata.engine.sampler import SampleRow
from kvstrata.engine.sampling_params import SamplingParams
from kvstrata.engine.scheduler import StepPlan
from kvstrata.radix import CacheConfig, StratifiedKVCache
from kvstrata.radix import attention as radix_attention

GEOMETRIES: dict[str, dict[str, Any]] = {
    "llama3-8b": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=500000.0,
        tie_word_embeddings=False,
        bos_token_id=128000,
        eos_token_id=128001,
    ),
    "tiny": dict(
        architectures=["LlamaForCausalLM"],
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
    ),
}


class DecodeRequest:
    """What `StepRunner` reads of a request: its tokens, its cache sequence and its sampling row."""

    def __init__(self, seq: Any, prompt_ids: list[int]) -> None:
        self.seq = seq
        self.prompt_ids = prompt_ids
        self.output_ids: list[int] = []
        self.pending = False  # its last sampled token is still on the device (overlap)
        self.mm = None
        self.row = SampleRow(SamplingParams(temperature=0.0, max_new_tokens=1 << 20, ignore_eos=True))

    @property
    def computed(self) -> int:
        return self.seq.length

    @property
    def tokens_len(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids) + self.pending

    def await_token(self) -> None:
        """As `Request.await_token`: the cache sees a placeholder until the token is read back."""
        self.pending = True
        self.seq.token_ids.append(0)

    def append(self, token: int) -> None:
        """As `Request.append`: the token in place of its placeholder (or after the last one)."""
        self.output_ids.append(token)
        if self.pending:
            self.seq.token_ids[len(self.prompt_ids) + len(self.output_ids) - 1] = token
        else:
            self.seq.token_ids.append(token)
        self.pending = False


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def hbm_bandwidth(device: torch.device, nbytes: int = 4 << 30) -> float:
    """Bytes/s of a large device-to-device copy (read + write), median of 20."""
    if device.type != "cuda":
        return float("nan")
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(22):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del src, dst
    return 2 * nbytes / statistics.median(times[2:])


def build_cache(net: Any, cfg: ModelConfig, kv: str, batch: int, tokens: int) -> StratifiedKVCache:
    """The engine's cache for ``kv`` (codecs, ring, sinks as the engine resolves them), sized for
    ``batch`` sequences of ``tokens`` tokens."""
    args = EngineArgs(kv_cache_dtype=kv, kv_plan="off", max_running_requests=batch)
    codecs = args.resolve_layer_codecs(cfg.num_layers, net.dtype)
    pages = batch * (tokens // args.page_size + 2) + 16
    cache_cfg = CacheConfig(
        num_layers=cfg.num_layers,
        kv_heads=cfg.kv_heads,
        head_dim=cfg.head_dim,
        page_size=args.page_size,
        recent_window=args.recent_window,
        max_recent_window=args.recent_window,
        layer_codecs=codecs,
        ring_dtype=args.resolve_ring_dtype(net.dtype),
        num_pages=pages,
        max_running=batch,
        sinks=args.resolve_sinks(codecs),
        device=net.device,
    )
    return StratifiedKVCache(cache_cfg)


FILL_TOKENS = 1 << 17


@torch.inference_mode()
def fill(
    cache: StratifiedKVCache, cfg: ModelConfig, batch: int, context: int, seed: int
) -> list[DecodeRequest]:
    """``batch`` sequences of ``context`` random tokens whose K/V (random, seeded) the cache stored
    through planned steps of whole sequences, as a prefill would: completed pages quantized, the
    window in the ring."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(10, cfg.vocab_size - 10, (batch, context), generator=g).tolist()
    seqs = [cache.admit(list(p)) for p in prompts]
    dev_gen = torch.Generator(device=cache.device).manual_seed(seed)
    # sequences a step: FILL_TOKENS rows of float32 K/V at once, or one sequence if it is longer
    # (B=1,024 at 2K in one step needed 24 GiB of temporaries beside a pool that fills the GPU)
    chunk = max(1, FILL_TOKENS // context)
    for start in range(0, batch, chunk):
        part = seqs[start : start + chunk]
        plan = cache.begin_step(part, [context] * len(part))
        shape = (len(part) * context, cfg.kv_heads, cfg.head_dim)
        for layer in range(cfg.num_layers):
            k = torch.randn(shape, generator=dev_gen, device=cache.device).to(cache.cfg.ring_dtype)
            v = torch.randn(shape, generator=dev_gen, device=cache.device).to(cache.cfg.ring_dtype)
            radix_attention.store(layer, plan, k, v, cache.pool, cache.ring, cache.sinks, cache.clips[layer])
            plan.layers_done.add(layer)
        cache.end_step(plan)
    reqs = [DecodeRequest(seq, p) for seq, p in zip(seqs, prompts, strict=True)]
    first = torch.randint(10, cfg.vocab_size - 10, (batch,), generator=g).tolist()
    for req, tok in zip(reqs, first, strict=True):  # the token the prefill would have sampled
        req.append(tok)
    return reqs


def step_bytes(cache: StratifiedKVCache, plan: Any) -> int:
    """K/V bytes the plan's attention reads, all layers: cold pages (codes and scales), ring rows,
    sink pages."""
    cfg = cache.cfg
    row = (
        cfg.num_layers
        * 2
        * cfg.kv_heads
        * cfg.head_dim
        * torch.empty((), dtype=cfg.ring_dtype).element_size()
    )
    total = 0
    for g in plan.groups:
        total += sum(g.cold_pages) * cache.pool.page_bytes
        total += sum(g.ring_len) * row
        total += sum(bool(s) for s in g.sink_valid) * cfg.page_size * row
    return total


class Decoder:
    """The engine's decode loop over fixed requests: plan, run, append the greedy tokens.

    ``overlap`` (the CUDA default of `EngineCore`, ``_run_overlapped``): step N+1 is planned and
    launched before step N's ids are read back; its input ids are copied from step N's samples on the
    device. Each `step` then returns once the step before it is read back, one step stays in flight
    (`settle` reads it)."""

    def __init__(
        self, cache: StratifiedKVCache, runner: StepRunner, reqs: list[DecodeRequest], overlap: bool = False
    ) -> None:
        self.cache, self.runner, self.reqs = cache, runner, reqs
        self.overlap = overlap
        self.ones = [1] * len(reqs)
        self.plan_s: list[float] = []
        self.last_plan: Any = None
        self.inflight: Launched | None = None

    def step(self) -> None:
        t = time.perf_counter()
        batch = self.cache.begin_step([r.seq for r in self.reqs], self.ones)
        self.plan_s.append(time.perf_counter() - t)
        self.last_plan = batch
        plan = StepPlan(self.reqs, self.ones, batch)
        if not self.overlap:
            sampled, out, _ = self.runner.run(plan)
            assert out is not None and len(sampled) == len(self.reqs)
            self._absorb(sampled, out.tokens)
            return
        step = self.runner.launch(plan, self.inflight)
        self.settle()
        self.cache.end_step(batch)
        for req in self.reqs:
            req.await_token()
        self.inflight = step

    def settle(self) -> None:
        """Read back and append the tokens of the step in flight, if any."""
        step, self.inflight = self.inflight, None
        if step is not None:
            assert step.sample is not None and len(step.sampled) == len(self.reqs)
            self._absorb(step.sampled, self.runner.sampler.collect(step.sample).tokens)

    @staticmethod
    def _absorb(sampled: list[Any], tokens: list[int]) -> None:
        for req, tok in zip(sampled, tokens, strict=True):
            req.append(tok)


def profile_steps(decoder: Any, steps: int, device: torch.device, trace: str | None = None) -> dict[str, Any]:
    """Kernel-busy vs idle time over ``steps`` calls of ``decoder.step()`` (torch.profiler, CUPTI kernel
    records); a `Decoder`'s last step is settled (its ids read back) inside the window, steppers without
    ``settle`` (prefill_gpu's) are synchronous. ``trace``: also write the profile as a Chrome trace there."""
    from torch.profiler import ProfilerActivity, profile, record_function

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    sync(device)
    with profile(activities=activities) as prof:
        for i in range(steps):
            with record_function("decode_step"):
                decoder.step()
                if i == steps - 1 and hasattr(decoder, "settle"):  # the last step's ids (overlap)
                    decoder.settle()
        sync(device)
    if trace:
        prof.export_chrome_trace(trace)
    events = prof.events()
    windows = [(e.time_range.start, e.time_range.end) for e in events if e.name == "decode_step"]
    kernels = [
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start
    ]
    if not kernels and device.type == "cuda":  # older layouts: read the raw Kineto records
        raw = prof.profiler.kineto_results.events()
        cuda = torch.autograd.DeviceType.CUDA
        windows = [(e.start_ns() / 1e3, e.end_ns() / 1e3) for e in raw if e.name() == "decode_step"]
        kernels = [(e.start_ns() / 1e3, e.end_ns() / 1e3, e.name()) for e in raw if e.device_type() == cuda]
    if not windows:
        return {}
    t0, t1 = min(w[0] for w in windows), max(w[1] for w in windows)
    inside = sorted(((max(s, t0), min(e, t1), n) for s, e, n in kernels if e > t0 and s < t1), key=_order)
    leaves = leaf_records(inside)
    busy = busy_us(inside)
    by_kind: dict[str, float] = {}
    by_name: dict[str, float] = {}
    for s, e, name in leaves:
        by_kind[kernel_kind(name)] = by_kind.get(kernel_kind(name), 0.0) + (e - s)
        by_name[name[:90]] = by_name.get(name[:90], 0.0) + (e - s)  # names as printed, summed
    wall = t1 - t0
    top = sorted(by_name.items(), key=lambda kv: -kv[1])[:12]
    return {
        "wall_ms_per_step": wall / steps / 1e3,
        "busy_ms_per_step": busy / steps / 1e3,
        "idle_ms_per_step": (wall - busy) / steps / 1e3,
        "leaf_busy_ms_per_step": busy_us(leaves) / steps / 1e3,
        "kernels_per_step": len(leaves) / steps,
        "enclosing_records": len(inside) - len(leaves),
        "kernel_ms_per_step_by_kind": {
            k: v / steps / 1e3 for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },
        "top_kernels_ms_per_step": {name: v / steps / 1e3 for name, v in top},
    }


def _order(record: tuple[float, float, str]) -> tuple[float, float]:
    return record[0], -record[1]


def leaf_records(records: list[tuple[float, float, str]]) -> list[tuple[float, float, str]]:
    """Of ``(start, end, name)`` records sorted by `_order` (longest first among equal starts), those
    that enclose no other record.

    A record that spans others (a graph-level record next to the kernels it ran) counts for busy time
    but not in the breakdown. Kernels that merely overlap (a dependent launch starting before its
    predecessor ends, or kernels on two streams) are all kept: an overlap is not an enclosure."""
    leaves = []
    for i, (s, e, name) in enumerate(records):
        encloses = False
        for s2, e2, _ in records[i + 1 :]:
            if s2 >= e:
                break
            if e2 <= e:
                encloses = True
                break
        if not encloses:
            leaves.append((s, e, name))
    return leaves


def busy_us(spans: list[tuple[float, float, str]]) -> float:
    """Length of the union of the (start-sorted) ``(start, end, name)`` intervals."""
    busy, cur_s, cur_e = 0.0, 0.0, None
    for s, e, _ in spans:
        if cur_e is None or s > cur_e:
            busy += 0.0 if cur_e is None else cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    return busy + (0.0 if cur_e is None else cur_e - cur_s)


def kernel_kind(name: str) -> str:
    lowered = name.lower()
    for kind, keys in (
        ("attention (Triton)", ("_attend_", "_decode_", "_decode4_", "_merge", "_extend_kernel", "_dequant")),
        ("attention (SDPA flash)", ("flash", "fmha")),
        ("fused dense (Triton)", ("rms_norm_kernel", "silu_mul_kernel", "rope_qkv_kernel")),
        ("page quantize (Triton)", ("_page_quantize",)),
        ("matmul (cuBLAS/CUTLASS)", ("gemm", "nvjet", "cutlass", "sm90_xmma", "gemv")),
        ("copies", ("memcpy", "memset", "copy_kernel")),
        ("sampling (argmax/reduce)", ("argmax", "reduce_kernel", "isnan", "isinf")),
    ):
        if any(k in lowered for k in keys):
            return kind
    return "other elementwise"


def run_codec(
    net: Any,
    cfg: ModelConfig,
    kv: str,
    plan: str,
    dense: str,
    loop: str,
    graph: str,
    args: argparse.Namespace,
    bw: float,
) -> dict[str, Any]:
    device = net.device
    fused.MODE = DENSE_MODES[dense]
    gc.collect()  # the previous run's cache (reference cycles) before this one's: two BF16 caches
    if device.type == "cuda":  # of 256 x 2K tokens do not fit one GPU
        torch.cuda.empty_cache()
    total = args.context + args.warmup + args.steps + args.profile_steps + 1
    cache = build_cache(net, cfg, kv, args.batch, total)
    if plan == "lists":  # the plan's page tables and ring rows built on the host every step
        cache.page_tables = None
    reqs = fill(cache, cfg, args.batch, args.context, args.seed)
    backend = get_backend("triton" if device.type == "cuda" else "torch", cache, cfg.attn_scale)
    graphs = None
    if device.type == "cuda":
        if graph == "full":
            context = max(cfg.max_position_embeddings, total)  # the engine's bound, or the run's if longer
            graphs = FullDecodeGraphs(net, args.batch, cache, backend, context)
        else:
            graphs = DecodeGraphs(net, args.batch)
        graphs.sizes = [args.batch]  # only the measured batch size is captured
        graphs.capture()
    runner = StepRunner(net, cache, backend, device, graphs)
    decoder = Decoder(cache, runner, reqs, overlap=loop == "overlap")
    with torch.inference_mode():
        for _ in range(args.warmup):
            decoder.step()
        if loop == "sync":
            sync(device)
        # The time between two steps' returns: sync, a step from its plan to its sampled ids on the
        # host; overlap, the steady state's interval (each return reads back the step before).
        times = []
        last = time.perf_counter()
        for _ in range(args.steps):
            decoder.step()
            if loop == "sync":
                sync(device)
            now = time.perf_counter()
            times.append(now - last)
            last = now
        decoder.settle()
        sync(device)
        kv_bytes = step_bytes(cache, decoder.last_plan)
        trace = f"{args.trace}.{kv}.{plan}.{dense}.{loop}.{graph}.json" if args.trace else None
        prof = profile_steps(decoder, args.profile_steps, device, trace)
    weights = sum(
        p.numel() * p.element_size() for n, p in net.named_parameters() if not n.startswith("embed.")
    )
    if cfg.tie_word_embeddings:
        weights += net.embed.weight.numel() * net.embed.weight.element_size()
    ms = 1e3 * statistics.median(times)
    floor_ms = 1e3 * (weights + kv_bytes) / bw
    tokens = hashlib.sha1(json.dumps([r.output_ids for r in reqs]).encode()).hexdigest()[:16]
    assert graphs is None or graphs.replayed_steps == args.warmup + args.steps + args.profile_steps
    plan_ms = 1e3 * statistics.median(decoder.plan_s[args.warmup :])
    del decoder, runner, graphs, cache, reqs
    return {
        "kv": kv,
        "plan": plan,
        "dense": dense,
        "loop": loop,
        "graph": graph,
        "ms_per_step": ms,
        "ms_mean": 1e3 * statistics.mean(times),
        "ms_spread": [1e3 * min(times), 1e3 * max(times)],
        "weight_bytes": weights,
        "kv_bytes": kv_bytes,
        "floor_ms": floor_ms,
        "ratio": ms / floor_ms,
        "begin_step_ms": plan_ms,
        "tokens_sha1": tokens,
        "profile": prof,
    }


DENSE_MODES = {"torch": "off", "fused": "auto"}
LOOPS = ("sync", "overlap")
GRAPHS = ("piecewise", "full")


def run_name(r: dict[str, Any]) -> str:
    return f"{r['plan']} {r['dense']} {r['loop']} {r['graph']}"


def profile_table(r: dict[str, Any], batch: int) -> str:
    """Markdown: kernel ms per step by kind against the step's wall time, then the top kernels."""
    p = r["profile"]
    if not p:
        return ""
    wall = p["wall_ms_per_step"]
    kinds = p["kernel_ms_per_step_by_kind"]
    weight_bytes = r["weight_bytes"]
    lines = [
        f"#### dense {r['dense']}, history {r['kv']}, plan {r['plan']}, loop {r['loop']}, "
        f"graph {r['graph']}: "
        f"{p['kernels_per_step']:.0f} kernels "
        f"per step, profiled wall {wall:.2f} ms/step",
        "",
        "| kind | ms/step | share of wall |",
        "|---|---:|---:|",
    ]
    for kind, ms in kinds.items():
        note = ""
        if kind.startswith("matmul") and ms > 0:
            params = weight_bytes / 2  # BF16 weights
            note = (
                f" ({2 * batch * params / (ms * 1e-3) / 1e12:.0f} TFLOP/s, "
                f"{weight_bytes / (ms * 1e-3) / 1e12:.2f} TB/s of weights)"
            )
        lines.append(f"| {kind}{note} | {ms:.2f} | {100 * ms / wall:.1f}% |")
    kernel_ms = sum(kinds.values())
    lines.append(f"| all kernels | {kernel_ms:.2f} | {100 * kernel_ms / wall:.1f}% |")
    running = p["leaf_busy_ms_per_step"]
    if kernel_ms - running > 0.005:
        over = kernel_ms - running
        lines.append(f"| of which overlapped by other kernels | {over:.2f} | {100 * over / wall:.1f}% |")
    gap = wall - running
    lines.append(f"| no kernel running (launch/host gaps) | {gap:.2f} | {100 * gap / wall:.1f}% |")
    lines += ["", "| top kernels | ms/step |", "|---|---:|"]
    lines += [f"| `{name}` | {ms:.3f} |" for name, ms in p["top_kernels_ms_per_step"].items()]
    return "\n".join(lines) + "\n"


def set_split_k(net: torch.nn.Module, spec: str) -> None:
    """Sets ``Linear.split_k`` of every layer's output (``o``) and down (``down``) products from
    ``"o=S,down=S"`` (either may be left out)."""
    modules = {"o": lambda layer: layer.attn.wo, "down": lambda layer: layer.mlp.w2}
    for item in filter(None, spec.split(",")):
        name, _, value = item.partition("=")
        if name not in modules or not value.isdigit() or int(value) < 1:
            raise ValueError(f"--split-k takes o=S,down=S with S >= 1, got {item!r}")
        for layer in net.layers:
            linear = modules[name](layer)
            split_k_chunk(linear.in_features, int(value))
            linear.split_k = int(value)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--kv", default="auto,fp8_e4m3", help="history codecs, comma-separated")
    ap.add_argument("--warmup", type=int, default=17, help="steps first (17: one completes pages)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--profile-steps", type=int, default=5)
    ap.add_argument("--geometry", default="llama3-8b", choices=sorted(GEOMETRIES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--label", default="", help="a name for this version of the code in the table")
    ap.add_argument(
        "--plan",
        default="table",
        help="comma-separated: table (page tables gathered from the cache's device table), lists "
        "(built from the sequences' lists every step); each runs every codec",
    )
    ap.add_argument(
        "--dense",
        default="fused",
        help="comma-separated: torch (the dense half as torch ops), fused (the Triton kernels of "
        "kvstrata.engine.fused, the CUDA default); each runs every codec",
    )
    ap.add_argument(
        "--loop",
        default="sync",
        help="comma-separated: sync (each step read back before the next is planned), overlap (the "
        "engine's CUDA default: step N+1 launched before step N is read back); each runs every codec",
    )
    ap.add_argument(
        "--graph",
        default="piecewise",
        help="comma-separated (CUDA): piecewise (dense parts in graphs, attention eager between them), "
        "full (the whole step in one graph); each runs every codec",
    )
    ap.add_argument(
        "--blas-library",
        default=None,
        choices=["cublas", "cublaslt"],
        help="the cuBLAS library PyTorch prefers for the matmuls, for the whole process "
        "(torch.backends.cuda.preferred_blas_library; default: PyTorch's own choice)",
    )
    ap.add_argument(
        "--split-k",
        default="",
        help="CUDA: run products split along their inputs by hand (`split_k_linear`), as o=S,down=S "
        "(the attention output and MLP down products; default: neither)",
    )
    ap.add_argument("--profile", default=None, help="write the kernel tables (markdown) here")
    ap.add_argument("--json", default=None, help="write the results here")
    ap.add_argument(
        "--trace",
        default=None,
        help="write each run's profiled steps as a Chrome trace, TRACE.<kv>.<plan>.<dense>.<loop>.json",
    )
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.blas_library and device.type != "cuda":
        ap.error("--blas-library needs a CUDA device")
    if args.blas_library:
        torch.backends.cuda.preferred_blas_library(args.blas_library)
    blas = torch.backends.cuda.preferred_blas_library().name.lower() if device.type == "cuda" else "none"
    cfg = ModelConfig.from_hf(GEOMETRIES[args.geometry])
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    net = dummy_model(cfg, dtype, device, seed=args.seed)
    try:
        set_split_k(net, args.split_k)
    except ValueError as err:
        ap.error(str(err))
    bw = hbm_bandwidth(device) if device.type == "cuda" else 50e9
    gpu = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    denses = args.dense.split(",")
    if unknown := set(denses) - set(DENSE_MODES):
        ap.error(f"--dense takes {', '.join(DENSE_MODES)}, got {', '.join(sorted(unknown))}")
    loops = args.loop.split(",")
    if unknown := set(loops) - set(LOOPS):
        ap.error(f"--loop takes {', '.join(LOOPS)}, got {', '.join(sorted(unknown))}")
    graph_modes = args.graph.split(",")
    if unknown := set(graph_modes) - set(GRAPHS):
        ap.error(f"--graph takes {', '.join(GRAPHS)}, got {', '.join(sorted(unknown))}")
    results = [
        run_codec(net, cfg, kv, plan, dense, loop, graph, args, bw)
        for dense in denses
        for plan in args.plan.split(",")
        for kv in args.kv.split(",")
        for loop in loops
        for graph in graph_modes
    ]
    print(
        f"\ndecode step, {args.geometry} geometry (random BF16 weights), batch {args.batch}, context "
        f"{args.context}; {gpu}, torch {torch.__version__}, BLAS {blas}; copy bandwidth {bw / 1e9:.0f} GB/s\n"
    )
    print(
        "| code | history | ms/step (median) | mean | floor ms (weights + KV read) | ratio | begin_step ms "
        "| GPU busy ms | idle ms | tokens sha1 |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in results:
        p = r["profile"]
        print(
            f"| {args.label} {run_name(r)} | {r['kv']} | {r['ms_per_step']:.2f} "
            f"| {r['ms_mean']:.2f} "
            f"| {r['floor_ms']:.2f} "
            f"({(r['weight_bytes'] + r['kv_bytes']) / 1e9:.1f} GB) | {r['ratio']:.2f}x "
            f"| {r['begin_step_ms']:.2f} | {p.get('busy_ms_per_step', float('nan')):.2f} "
            f"| {p.get('idle_ms_per_step', float('nan')):.2f} | {r['tokens_sha1']} |"
        )
    for r in results:
        kinds = r["profile"].get("kernel_ms_per_step_by_kind", {})
        parts = ", ".join(f"{k} {v:.2f}" for k, v in kinds.items())
        print(f"{args.label} {run_name(r)} {r['kv']}: kernel ms/step by kind: {parts}")
        for kernel, ms in r["profile"].get("top_kernels_ms_per_step", {}).items():
            print(f"    {ms:7.3f} ms  {kernel}")
    if args.profile:
        with open(args.profile, "w") as f:
            head = f"decode step profile, batch {args.batch}, context {args.context}, {gpu}, BLAS {blas}"
            f.write(head + "\n\n")
            f.write("\n".join(profile_table(r, args.batch) for r in results))
    if args.json:
        with open(args.json, "w") as f:
            run = {"label": args.label, "device": gpu, "blas": blas, "bandwidth": bw, "split_k": args.split_k}
            json.dump({**run, "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
