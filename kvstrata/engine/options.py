"""Engine configuration: the knobs of `kvstrata.Engine`, validated, and what they resolve to."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from kvstrata.engine.defaults import (
    DEFAULT_KV_CACHE_DTYPE,
    codec_defaults,
    is_plan_path,
    plan_defaults,
    read_plan_file,
)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_TOTAL_TOKENS = 16384
RAW_CODECS = ("fp32", "bf16")


@dataclass
class EngineArgs:
    model: str | None = None  # HF directory, GGUF file, or None for the embedded default
    dtype: str = "auto"  # compute dtype: auto = float32 on CPU, bfloat16 on CUDA
    # A codec name, "auto" (stored in the compute dtype, no quantization) or a plan JSON file path.
    kv_cache_dtype: str = DEFAULT_KV_CACHE_DTYPE
    # None = the shipped default of the codec or plan (kvstrata/engine/defaults.py).
    recent_window: int | None = None  # BF16 ring tokens per sequence (multiple of page_size)
    page_size: int = 16
    layer_plan: list[str] | str | None = None  # per-layer codec names, or a plan JSON file
    rotation: bool | None = None
    sinks: bool | None = None  # first page also kept in the ring dtype
    kv_scales: str | None = None  # calibration scales file (static clip values)
    ring_dtype: str = "auto"  # auto = compute dtype when unquantized, else bfloat16
    max_total_tokens: int | None = None  # cold pool size in tokens (wins over mem_fraction_static)
    mem_fraction_static: float | None = None  # share of free memory for the cold pool
    max_running_requests: int = 32
    chunked_prefill_size: int = 512
    # Prefill chunks share a step with the running decodes (SGLang's flag); off: prefill-only steps
    # while prompt tokens can be scheduled, decode-only steps otherwise (scheduler.py).
    enable_mixed_chunk: bool = False
    # A prompt that would be cut at the end of a prefill step waits for the next step when the step
    # already holds this share of chunked_prefill_size and the prompt fits one step whole (its tail would
    # read its head back as history); 1: always cut, as SGLang does (scheduler.py).
    prefill_defer_fill: float = 0.75
    device: str = "auto"
    drift_sample_rate: float = 0.0  # share of finished requests re-scored without quantization
    drift_threshold: float = 0.05  # smoothed drift (|ppl ratio - 1| or KL) that triggers fallback
    drift_metric: str = "ppl"  # "ppl": |quantized/reference perplexity - 1|; "kl": mean KL(ref || served)
    drift_max_level: int = 2  # fallback level k: window = recent_window * 2**k
    drift_max_tokens: int = 64  # generated steps recorded per sampled request (fp32 rows of vocab size)
    drift_ewma_alpha: float = 0.3
    drift_cooldown: int = 4  # consecutive low samples before stepping down
    seed: int | None = None  # seeds the unseeded sampling rows (torch default generator)
    load_format: str = "auto"  # "dummy": random weights from the model directory's config.json alone
    # Load-time precision plan (kvstrata/engine/kvplan.py): "auto" runs the sensitivity pass when one
    # quantized codec covers every layer and keeps the layers that fail it at a wider codec; "off".
    kv_plan: str = "auto"
    kv_plan_out: str | None = None  # also write the chosen plan here (reuse: --kv-cache-dtype plan.json)
    kv_plan_tokens: int = 256  # corpus tokens of the pass
    kv_plan_kl_budget: float | None = None  # KL (nats/token, window 0 + sinks); None: by codec width
    kv_plan_extra_bytes: float = 0.038  # cold bytes/token a plan may add, as a share of BF16's
    # Precision raise of the drift fallback (kvstrata/engine/drift.py): codecs of the raised pool that new
    # text pages go to at fallback level >= 1. "auto": each layer's K and V one step wider
    # (kvplan.WIDER_K/WIDER_V); a codec name: that codec everywhere; "off": the fallback only widens the
    # window. Only with drift_sample_rate > 0.
    drift_raise_dtype: str = "auto"
    drift_raise_share: float = 0.25  # share of the cold pool's bytes given to the raised pool
    extra: dict[str, Any] = field(default_factory=dict)
    # Pinned prefixes (image spans, POST /v1/cache/pins): budget in tokens (None: a quarter of the
    # pool) and the time-to-live of image pins in seconds (None: until unpinned or flushed).
    max_pinned_tokens: int | None = None
    pin_ttl: float | None = 3600.0
    # Images (vision-language models): http(s) fetching only from these hosts (empty: off).
    allowed_image_hosts: list[str] | str | None = None
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096
    image_fetch_timeout: float = 10.0
    # Codec of image-token history (pages holding image tokens, in a pool of their own): a codec name,
    # or "auto" (see `resolve_vision_codec`).
    vision_kv_dtype: str = "auto"
    # Decode steps in piecewise CUDA graphs (SGLang's flag names): on by default on CUDA (nothing to
    # do on CPU); batches above cuda_graph_max_bs (None: max_running_requests) run eager.
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    # "full" (the default): the whole decode step (attention and KV store too) in one graph per bucket
    # (kvstrata/engine/full_graph.py; triton backend, no image pool, raised pool or static scales, else
    # piecewise); "piecewise": dense parts in graphs, attention eager between them (cuda_graph.py).
    cuda_graph_mode: str = "full"
    # Overlap scheduling (SGLang's flag name): on CUDA the next step is planned and launched before
    # the sampled ids of the step running on the device are read back (off on CPU: nothing to hide).
    disable_overlap_schedule: bool = False
    # Warm-up workload at start (kvstrata/engine/warmup.py): "off", "on", or "cuda" (only on CUDA, where
    # Triton compiles kernel variants on first use: `kvstrata serve`'s default, SGLang's server warm-up).
    warmup: str = "off"

    def __post_init__(self) -> None:
        """Fill the window, rotation and sinks left unset from the shipped defaults (or the plan file)."""
        if self.layer_plan is None and is_plan_path(self.kv_cache_dtype):
            self.layer_plan = self.kv_cache_dtype
        if isinstance(self.layer_plan, (str, os.PathLike)):
            defaults = plan_defaults(read_plan_file(self.layer_plan))
        elif self.layer_plan is not None:
            defaults = plan_defaults({})
        else:
            defaults = codec_defaults(self.kv_cache_dtype)
        if self.recent_window is None:
            self.recent_window = defaults.recent_window
        if self.rotation is None:
            self.rotation = defaults.rotation
        if self.sinks is None:
            self.sinks = defaults.sinks

    def validate(self) -> None:
        if self.dtype not in ("auto", *DTYPES):
            raise ValueError(f"dtype must be auto, float32, bfloat16 or float16, got {self.dtype!r}")
        if self.ring_dtype not in ("auto", *DTYPES):
            raise ValueError(f"ring_dtype must be auto or a dtype name, got {self.ring_dtype!r}")
        if self.warmup not in ("off", "cuda", "on"):
            raise ValueError(f"warmup must be off, cuda or on, got {self.warmup!r}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.recent_window < 0 or self.recent_window % self.page_size:
            raise ValueError(
                f"recent_window must be a non-negative multiple of page_size ({self.page_size}), "
                f"got {self.recent_window}"
            )
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be >= 1, got {self.chunked_prefill_size}")
        if not 0.0 <= self.prefill_defer_fill <= 1.0:
            raise ValueError(f"prefill_defer_fill must be in [0, 1], got {self.prefill_defer_fill}")
        if self.max_total_tokens is not None and self.max_total_tokens < self.page_size:
            raise ValueError(f"max_total_tokens must be >= page_size, got {self.max_total_tokens}")
        if self.max_pinned_tokens is not None and self.max_pinned_tokens < 0:
            raise ValueError(f"max_pinned_tokens must be >= 0, got {self.max_pinned_tokens}")
        if self.pin_ttl is not None and self.pin_ttl <= 0:
            raise ValueError(f"pin_ttl must be > 0 seconds, got {self.pin_ttl}")
        if self.vision_kv_dtype != "auto":
            from kvstrata.quant import get_codec

            get_codec(self.vision_kv_dtype)  # raises listing the known codecs
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"mem_fraction_static must be in (0, 1), got {self.mem_fraction_static}")
        if not 0.0 <= self.drift_sample_rate <= 1.0:
            raise ValueError(f"drift_sample_rate must be in [0, 1], got {self.drift_sample_rate}")
        if self.drift_threshold <= 0:
            raise ValueError(f"drift_threshold must be > 0, got {self.drift_threshold}")
        if self.drift_metric not in ("ppl", "kl"):
            raise ValueError(f"drift_metric must be 'ppl' or 'kl', got {self.drift_metric!r}")
        if self.drift_max_level < 0:
            raise ValueError(f"drift_max_level must be >= 0, got {self.drift_max_level}")
        if self.drift_raise_dtype not in ("auto", "off"):
            from kvstrata.quant import get_codec

            get_codec(self.drift_raise_dtype)  # raises listing the known codecs
        if not 0.0 < self.drift_raise_share < 1.0:
            raise ValueError(f"drift_raise_share must be in (0, 1), got {self.drift_raise_share}")
        if self.load_format not in ("auto", "dummy"):
            raise ValueError(f"load_format must be 'auto' or 'dummy', got {self.load_format!r}")
        if self.kv_plan not in ("auto", "off"):
            raise ValueError(f"kv_plan must be 'auto' or 'off', got {self.kv_plan!r}")
        if self.kv_plan_tokens < 2 * self.page_size:
            raise ValueError(f"kv_plan_tokens must be >= 2 pages, got {self.kv_plan_tokens}")
        if (self.kv_plan_kl_budget or 0) < 0 or self.kv_plan_extra_bytes < 0:
            raise ValueError("kv_plan_kl_budget and kv_plan_extra_bytes must be >= 0")
        if self.cuda_graph_mode not in ("full", "piecewise"):
            raise ValueError(f"cuda_graph_mode must be full or piecewise, got {self.cuda_graph_mode!r}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")

    # --- resolution ---------------------------------------------------------------------------
    def resolve_cuda_graph_max_bs(self) -> int:
        """Largest decode batch captured: cuda_graph_max_bs, at most max_running_requests."""
        return min(self.cuda_graph_max_bs or self.max_running_requests, self.max_running_requests)

    def resolve_warmup(self, device: torch.device) -> bool:
        """Whether the engine runs the warm-up workload when it starts."""
        return self.warmup == "on" or (self.warmup == "cuda" and device.type == "cuda")

    def resolve_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def resolve_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        return DTYPES[self.dtype]

    def resolve_ring_dtype(self, compute: torch.dtype) -> torch.dtype:
        if self.ring_dtype != "auto":
            return DTYPES[self.ring_dtype]
        unquantized = self.kv_cache_dtype in ("auto", *RAW_CODECS) and self.layer_plan is None
        return compute if unquantized else torch.bfloat16

    def resolve_sinks(self, codecs: list[str]) -> bool:
        """Attention sinks are on by default when history is quantized (kvstrata/engine/defaults.py):
        measured on the default model (8 prompts of 160 tokens, fp8_e4m3, window 128), greedy output
        kept >= 16 tokens equal to the unquantized run on 5 of 8 prompts without sinks and on 8 of 8
        with them; and the lab's fp8 drift went from +0.157% to -0.000%."""
        if self.sinks is not None:
            return self.sinks
        return any(c not in RAW_CODECS for c in codecs)

    def resolve_layer_codecs(self, num_layers: int, compute: torch.dtype) -> list[str]:
        from kvstrata.quant import get_codec
        from kvstrata.radix.pool import split_layer_codec

        if self.layer_plan is not None:
            codecs = load_plan(self.layer_plan)
            if len(codecs) != num_layers:
                raise ValueError(f"layer plan has {len(codecs)} layers, the model has {num_layers}")
        elif self.kv_cache_dtype == "auto":
            codecs = ["fp32" if compute == torch.float32 else "bf16"] * num_layers
        else:
            codecs = [self.kv_cache_dtype] * num_layers
        for name in set(codecs):
            for part in split_layer_codec(name):
                get_codec(part)  # raises listing the known codecs
        return codecs


def load_plan(plan: list[str] | str | os.PathLike[str]) -> list[str]:
    """A per-layer plan: a list of codec names, or a plan JSON file (`read_plan_file`)."""
    if isinstance(plan, list):
        return [str(x) for x in plan]
    return list(read_plan_file(plan)["layer_codecs"])  # type: ignore[arg-type]


def available_memory(device: torch.device) -> int:
    """Free bytes on the device (CUDA: driver's free memory; CPU: MemAvailable)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def pool_pages(args: EngineArgs, device: torch.device, bytes_per_page: int) -> int:
    """Cold pool size in pages: max_total_tokens, else mem_fraction_static of free memory."""
    if args.max_total_tokens is not None:
        return -(-args.max_total_tokens // args.page_size)
    if args.mem_fraction_static is None and device.type == "cpu":
        return DEFAULT_CPU_TOTAL_TOKENS // args.page_size  # 16,384 tokens: 0.75 GB in fp32, 0.2 GB in fp8
    fraction = args.mem_fraction_static if args.mem_fraction_static is not None else 0.8
    return max(1, int(available_memory(device) * fraction) // max(1, bytes_per_page))


def resolve_vision_codec(args: EngineArgs, codecs: list[str]) -> str | None:
    """The image pool's codec, or None when image pages share the text pool.

    ``auto``: no trained vision-language model is available to measure image-token K/V in the
    accuracy lab, so image pages are stored in BF16 (never quantized) when the text pool quantizes;
    with an unquantized pool they share it. Both attention backends read the image pool (the Triton
    kernels in a pass of their own), so the answer is the same on both."""
    name = args.vision_kv_dtype
    if name == "auto":
        if all(c in RAW_CODECS for c in codecs):
            return None
        name = "bf16"
    return None if all(c == name for c in codecs) else name


def pin_budget_bytes(args: EngineArgs, bytes_per_page: int) -> int | None:
    """``max_pinned_tokens`` as cold bytes (whole pages); None leaves the cache's default (a quarter)."""
    if args.max_pinned_tokens is None:
        return None
    return args.max_pinned_tokens // args.page_size * bytes_per_page


def image_hosts(args: EngineArgs) -> frozenset[str]:
    hosts = args.allowed_image_hosts or []
    if isinstance(hosts, str):
        hosts = hosts.split(",")
    return frozenset(h.strip().lower() for h in hosts if h.strip())
