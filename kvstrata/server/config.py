"""`kvstrata serve` options: one table drives the argparse flags, the KVSTRATA_* variables and the docs.

Precedence: command-line flag > ``KVSTRATA_<FLAG>`` environment variable > default. Engine options left
unset (``None``) are not passed to ``kvstrata.Engine``, so the engine's own defaults apply.
"""

from __future__ import annotations

import argparse
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, fields
from typing import Any

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 30000
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024
LOG_LEVELS = ("critical", "error", "warning", "info", "debug")
ATTENTION_BACKENDS = ("auto", "torch", "triton")


def _bool(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise argparse.ArgumentTypeError(f"not a boolean: {text!r}")


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0: {text}")
    return value


def _fraction(text: str) -> float:
    value = float(text)
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in [0, 1]: {text}")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0.0:
        raise argparse.ArgumentTypeError(f"must be > 0: {text}")
    return value


def _switch_interval(text: str) -> float:
    """`sys.setswitchinterval`'s seconds: it keeps whole microseconds, so a value under one (or not
    finite) would silently become 0."""
    value = float(text)
    if not 1e-6 <= value < math.inf:
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 1e-6: {text}")
    return value


# Young collections every 50,000 allocations, full ones after 100 middle ones: a streaming server's
# objects live for a request's whole life (about 220 each in the HTTP stack), so Python's 700,10,10
# kept promoting them and walked them all in full collections (docs/engine.md, "1,024 concurrent
# requests"). Measured on CPython 3.12 (the GPU image) and 3.11; 3.14's incremental collector reads
# the second and third thresholds differently.
GC_THRESHOLD = (50000, 20, 100)


def _gc_threshold(text: str) -> tuple[int, ...]:
    """`gc.set_threshold`'s 1 to 3 non-negative integers, separated by commas or spaces."""
    parts = text.replace(",", " ").split()
    try:
        values = tuple(int(p) for p in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not integers: {text!r}") from None
    if not 1 <= len(values) <= 3 or min(values) < 0:
        raise argparse.ArgumentTypeError(f"must be 1 to 3 integers >= 0: {text!r}")
    return values


def _port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"not a TCP port: {text}")
    return value


def _log_level(text: str) -> str:
    value = text.strip().lower()
    if value not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"one of {', '.join(LOG_LEVELS)}: {text!r}")
    return value


def _load_format(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "dummy"):
        raise argparse.ArgumentTypeError(f"auto or dummy: {text!r}")
    return value


def _attention_backend(text: str) -> str:
    value = text.strip().lower()
    if value not in ATTENTION_BACKENDS:
        raise argparse.ArgumentTypeError(f"one of {', '.join(ATTENTION_BACKENDS)}: {text!r}")
    return value


def _graph_mode(text: str) -> str:
    value = text.strip().lower()
    if value not in ("full", "piecewise"):
        raise argparse.ArgumentTypeError(f"full or piecewise: {text!r}")
    return value


def _engine_process(text: str) -> str:
    value = text.strip().lower()
    if value not in ("auto", "on", "off"):
        raise argparse.ArgumentTypeError(f"auto, on or off: {text!r}")
    return value


@dataclass(frozen=True)
class Flag:
    name: str  # the attribute name; flag is --name-with-dashes, env is KVSTRATA_NAME
    type: Callable[[str], Any]
    default: Any
    help: str
    engine: bool = False  # passed to kvstrata.Engine as a keyword argument

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def env(self) -> str:
        return "KVSTRATA_" + self.name.upper()


FLAGS: tuple[Flag, ...] = (
    Flag("model", str, None, "model path: HF safetensors dir or GGUF file; default: embedded SmolLM2", True),
    Flag("served_model_name", str, None, "model id in the API (default: the model's name)"),
    Flag("dtype", str, None, "compute dtype: auto, float32, bfloat16", True),
    Flag(
        "kv_cache_dtype",
        str,
        None,
        "history codec: fp8_e4m3 (default), fp8_e5m2, int8, int4, fp4_e2m1, auto (unquantized), "
        "or a per-layer plan .json from `kvstrata eval --emit-plan`",
        True,
    ),
    Flag(
        "recent_window",
        _non_negative_int,
        None,
        "BF16 recent window in tokens (multiple of page); default per codec (fp8: 128, fp4: 256)",
        True,
    ),
    Flag("page_size", _positive_int, None, "tokens per KV page", True),
    Flag("max_total_tokens", _positive_int, None, "KV capacity in tokens (cold pool size)", True),
    Flag(
        "mem_fraction_static",
        _fraction,
        None,
        "CUDA: share of total GPU memory for weights + KV pools (SGLang's meaning)",
        True,
    ),
    Flag("max_running_requests", _positive_int, None, "cap on concurrently running requests", True),
    Flag("kv_scales", str, None, "static KV scales file from `kvstrata calibrate`", True),
    Flag("host", str, DEFAULT_HOST, "address to bind"),
    Flag("port", _port, DEFAULT_PORT, "TCP port (0: pick a free one)"),
    Flag("api_key", str, None, "require `Authorization: Bearer <key>` on /v1/*"),
    Flag("drift_sample_rate", _fraction, None, "share of finished requests re-scored in BF16", True),
    Flag(
        "drift_threshold",
        _positive_float,
        None,
        "smoothed drift (perplexity ratio - 1) that raises precision",
        True,
    ),
    Flag(
        "kv_plan",
        str,
        None,
        "auto (default): at load, layers whose K or V fail a short sensitivity pass keep a wider codec; off",
        True,
    ),
    Flag(
        "kv_plan_out",
        str,
        None,
        "write the chosen per-layer plan here (serve it: --kv-cache-dtype FILE)",
        True,
    ),
    Flag("log_level", _log_level, "info", "critical, error, warning, info, debug"),
    Flag("context_length", _positive_int, None, "cap on prompt + output tokens (default: the model's)"),
    Flag("max_request_bytes", _positive_int, DEFAULT_MAX_REQUEST_BYTES, "largest accepted request body"),
    Flag("protect_metrics", _bool, False, "require the API key on /metrics too"),
    Flag(
        "load_format",
        _load_format,
        None,
        "auto (read the weights) or dummy (random weights from the model directory's config.json)",
        True,
    ),
    Flag(
        "attention_backend",
        _attention_backend,
        None,
        "attention kernels: auto (triton on CUDA, torch on CPU), torch, triton",
        True,
    ),
    Flag(
        "max_pinned_tokens",
        _non_negative_int,
        None,
        "pinned-prefix budget in tokens (default: 1/4 of the pool)",
        True,
    ),
    Flag("pin_ttl", _positive_float, None, "seconds an image-span pin lives (engine default 3600)", True),
    Flag(
        "allowed_image_hosts",
        str,
        None,
        "comma-separated hosts image_url may fetch from (default: none, off)",
        True,
    ),
    Flag(
        "max_image_bytes",
        _positive_int,
        None,
        "largest accepted image in bytes (engine default 20 MiB)",
        True,
    ),
    Flag(
        "max_image_pixels",
        _positive_int,
        None,
        "largest accepted image in pixels (engine default 4096^2)",
        True,
    ),
    Flag("image_fetch_timeout", _positive_float, None, "seconds allowed to fetch one image URL", True),
    Flag(
        "vision_kv_dtype",
        str,
        None,
        "codec of image-token pages (own pool; torch backend): auto (bf16 when the pool quantizes) "
        "or a codec name",
        True,
    ),
    Flag("disable_cuda_graph", _bool, None, "CUDA: run decode steps eagerly (no CUDA graphs)", True),
    Flag(
        "disable_overlap_schedule",
        _bool,
        None,
        "CUDA: plan each step only after the previous step's ids are read back (no overlap scheduling)",
        True,
    ),
    Flag(
        "skip_server_warmup",
        _bool,
        None,
        "skip the warm-up workload at start (default: run it on CUDA, where it compiles the kernel "
        "variants serving meets; kvstrata/engine/warmup.py)",
    ),
    Flag(
        "cuda_graph_mode",
        _graph_mode,
        None,
        "CUDA: full (the default: the whole decode step in one graph per batch bucket, attention "
        "included; triton backend, else piecewise) or piecewise (attention eager between graphs)",
        True,
    ),
    Flag(
        "cuda_graph_max_bs",
        _positive_int,
        None,
        "CUDA: largest decode batch captured in graphs (default: max running requests)",
        True,
    ),
    Flag(
        "chunked_prefill_size",
        _positive_int,
        None,
        "prompt tokens computed per step, over all prefilling requests (engine default 512)",
        True,
    ),
    Flag(
        "enable_mixed_chunk",
        _bool,
        None,
        "running decodes share steps with prefill chunks (default off)",
        True,
    ),
    Flag(
        "prefill_defer_fill",
        _fraction,
        None,
        "a prompt that would be cut at the end of a prefill step waits for the next step when the step "
        "already holds this share of --chunked-prefill-size and the prompt fits a step whole "
        "(engine default 0.75; 1: always cut, as SGLang)",
        True,
    ),
    Flag(
        "drift_raise_dtype",
        str,
        None,
        "codecs new text pages get at drift fallback level >= 1: auto (each layer's K and V one step "
        "wider), a codec name, or off (the fallback only widens the window)",
        True,
    ),
    Flag("drift_raise_share", _fraction, None, "share of the cold pool's bytes for the raised pool", True),
    Flag(
        "engine_process",
        _engine_process,
        "auto",
        "run the engine in its own process, apart from the HTTP server's event loop and its GIL (as "
        "SGLang runs its scheduler): on, off, or auto (on when CUDA is available)",
    ),
    Flag(
        "switch_interval",
        _switch_interval,
        None,
        "seconds a thread may hold the GIL while another waits (sys.setswitchinterval; Python's 0.005): "
        "the engine thread and the HTTP event loop share it",
    ),
    Flag(
        "gc_threshold",
        _gc_threshold,
        GC_THRESHOLD,
        "garbage collector thresholds, 1 to 3 integers separated by commas (gc.set_threshold; SGLang's "
        "--gc-threshold; Python's are 700,10,10): at 1,024 streams on one H200 Python's ran 29 full "
        "collections (4.7 s, up to 253 ms each, both threads stopped) where the default ran none",
    ),
)


@dataclass
class ServerConfig:
    model: str | None = None
    served_model_name: str | None = None
    dtype: str | None = None
    kv_cache_dtype: str | None = None
    recent_window: int | None = None
    page_size: int | None = None
    max_total_tokens: int | None = None
    mem_fraction_static: float | None = None
    max_running_requests: int | None = None
    kv_scales: str | None = None
    host: str = DEFAULT_HOST
    port: int = DEFAULT_PORT
    api_key: str | None = None
    drift_sample_rate: float | None = None
    drift_threshold: float | None = None
    kv_plan: str | None = None
    kv_plan_out: str | None = None
    log_level: str = "info"
    context_length: int | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    protect_metrics: bool = False
    load_format: str | None = None
    attention_backend: str | None = None
    max_pinned_tokens: int | None = None
    pin_ttl: float | None = None
    allowed_image_hosts: str | None = None
    max_image_bytes: int | None = None
    max_image_pixels: int | None = None
    image_fetch_timeout: float | None = None
    vision_kv_dtype: str | None = None
    disable_cuda_graph: bool | None = None
    disable_overlap_schedule: bool | None = None
    skip_server_warmup: bool | None = None
    cuda_graph_mode: str | None = None
    cuda_graph_max_bs: int | None = None
    chunked_prefill_size: int | None = None
    enable_mixed_chunk: bool | None = None
    prefill_defer_fill: float | None = None
    drift_raise_dtype: str | None = None
    drift_raise_share: float | None = None
    engine_process: str = "auto"
    switch_interval: float | None = None
    gc_threshold: tuple[int, ...] | None = GC_THRESHOLD

    def engine_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``kvstrata.Engine``: only the options that were set."""
        names = {flag.name for flag in FLAGS if flag.engine}
        return {name: getattr(self, name) for name in names if getattr(self, name) is not None}

    def separate_engine(self) -> bool:
        """Whether `kvstrata serve` runs the engine in its own process (``--engine-process``)."""
        if self.engine_process != "auto":
            return self.engine_process == "on"
        import torch

        return torch.cuda.is_available()

    def warmup_mode(self) -> str:
        """The engine's ``warmup``: the server warms up on CUDA unless ``--skip-server-warmup``."""
        return "off" if self.skip_server_warmup else "cuda"

    @classmethod
    def from_namespace(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls)})


def add_flags(parser: argparse.ArgumentParser, environ: dict[str, str] | None = None) -> None:
    """Add every flag; a set ``KVSTRATA_<FLAG>`` variable becomes that flag's default."""
    env = os.environ if environ is None else environ
    for flag in FLAGS:
        raw = env.get(flag.env)
        default = flag.default
        if raw is not None:
            try:
                default = flag.type(raw)
            except (ValueError, argparse.ArgumentTypeError) as exc:
                parser.error(f"{flag.env}={raw!r}: {exc}")
        shown = "unset" if flag.default is None else flag.default
        help_text = f"{flag.help} [env {flag.env}; default {shown}]"
        if flag.type is _bool:
            parser.add_argument(
                flag.option,
                dest=flag.name,
                type=_bool,
                nargs="?",
                const=True,
                default=default,
                help=help_text,
            )
        else:
            parser.add_argument(flag.option, dest=flag.name, type=flag.type, default=default, help=help_text)
