"""`kvstrata capacity`: how many history tokens fit in a KV budget, per codec.

The budget first reserves the hot rings of ``--max-running`` sequences (``recent_window +
page_size`` BF16 tokens per layer each); the rest becomes cold pages of the chosen codec. The
ratio compares with BF16 history under the same ring reserve, and with a plain BF16 cache that
has no ring at all.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

from kvstrata import geometry
from kvstrata.geometry import Geometry

HELP = "How many history tokens fit in a KV memory budget (cold pages after the BF16 rings)."
GIB = 1 << 30
RING_BYTES = 2  # the hot ring is BF16


@dataclass(frozen=True)
class CapacityPlan:
    codec: str
    tokens: int
    pages: int
    budget_bytes: int
    ring_bytes: int
    cold_page_bytes: int
    cold_bytes_per_token: float
    ring_bytes_per_token: int
    bf16_tokens: int
    ratio_to_bf16: float
    plain_bf16_tokens: int
    ratio_to_plain_bf16: float


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--layers", type=int, default=None, help="transformer layers (default 32)")
    parser.add_argument("--kv-heads", type=int, default=None, help="KV heads per layer (default 8)")
    parser.add_argument("--head-dim", type=int, default=None, help="head dimension (default 128)")
    parser.add_argument("--budget-gib", type=float, default=40.0, help="KV memory budget in GiB")
    parser.add_argument("--kv-cache-dtype", default="fp4_e2m1", help="history codec (see kvstrata.quant)")
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--recent-window", type=int, default=128, help="BF16 tokens kept per sequence")
    parser.add_argument("--max-running", type=int, default=32, help="sequences whose rings are reserved")
    parser.add_argument("--model", default=None, help="read the geometry from a HF model dir or a GGUF file")
    parser.add_argument("--json", action="store_true", help="print one JSON object (key 'tokens')")
    parser.add_argument("--table", action="store_true", help="print a markdown table over all codecs")


def model_geometry(path: str | Path) -> Geometry:
    """Layers, KV heads and head dim from a HF ``config.json`` (file or directory) or a GGUF file
    (parsed by `kvstrata.geometry`, which the engine's model configuration uses too)."""
    path = Path(path)
    if path.is_dir():
        path = path / "config.json"
    if not path.exists():
        raise FileNotFoundError(f"no model config at {path}")
    if path.suffix == ".gguf":
        geo = geometry.from_gguf(_gguf_metadata(path))
    else:
        geo = geometry.from_hf(json.loads(path.read_text()))
    return dataclasses.replace(geo, q_heads=None)  # only the KV side sizes the cache


def _gguf_metadata(path: Path) -> dict[str, object]:
    """The architecture and its ``<arch>.*`` keys (not the tokenizer's large arrays)."""
    from gguf import GGUFReader

    fields = GGUFReader(str(path)).fields
    arch_field = fields.get("general.architecture")
    arch = arch_field.contents() if arch_field is not None else "llama"
    meta: dict[str, object] = {"general.architecture": arch}
    for key, field in fields.items():
        if key.startswith(f"{arch}."):
            meta[key] = field.contents()
    return meta


def plan_capacity(
    geo: Geometry,
    codec: str,
    budget_bytes: int,
    page_size: int = 16,
    recent_window: int = 128,
    max_running: int = 32,
) -> CapacityPlan:
    from kvstrata.radix.pool import cold_page_bytes

    ring_per_token = 2 * geo.layers * geo.kv_heads * geo.head_dim * RING_BYTES
    ring_bytes = max_running * (recent_window + page_size) * ring_per_token
    cold = max(budget_bytes - ring_bytes, 0)

    def pages(name: str, avail: int) -> tuple[int, int]:
        page_bytes = cold_page_bytes([name] * geo.layers, page_size, geo.kv_heads, geo.head_dim)
        return avail // page_bytes, page_bytes

    n_pages, page_bytes = pages(codec, cold)
    bf16_pages, _ = pages("bf16", cold)
    plain_pages, _ = pages("bf16", budget_bytes)
    tokens = n_pages * page_size
    return CapacityPlan(
        codec=codec,
        tokens=tokens,
        pages=n_pages,
        budget_bytes=budget_bytes,
        ring_bytes=ring_bytes,
        cold_page_bytes=page_bytes,
        cold_bytes_per_token=page_bytes / page_size,
        ring_bytes_per_token=ring_per_token,
        bf16_tokens=bf16_pages * page_size,
        ratio_to_bf16=tokens / max(bf16_pages * page_size, 1),
        plain_bf16_tokens=plain_pages * page_size,
        ratio_to_plain_bf16=tokens / max(plain_pages * page_size, 1),
    )


def _resolve_geometry(args: argparse.Namespace) -> Geometry:
    base = model_geometry(args.model) if args.model else Geometry(32, 8, 128)
    return Geometry(
        args.layers or base.layers, args.kv_heads or base.kv_heads, args.head_dim or base.head_dim
    )


def _text(plan: CapacityPlan, geo: Geometry, args: argparse.Namespace) -> str:
    gib = lambda b: f"{b / GIB:.3f} GiB"
    return "\n".join(
        [
            f"geometry        {geo.layers} layers x {geo.kv_heads} kv heads x head_dim {geo.head_dim}, "
            f"page {args.page_size}, window {args.recent_window}, {args.max_running} running",
            f"budget          {gib(plan.budget_bytes)} ({plan.budget_bytes} bytes)",
            f"ring overhead   {gib(plan.ring_bytes)} = {args.max_running} slots x "
            f"{args.recent_window + args.page_size} tokens x {plan.ring_bytes_per_token} B/token (bf16)",
            f"bytes/token     cold {plan.codec}: {plan.cold_bytes_per_token:.1f}   "
            f"ring bf16: {plan.ring_bytes_per_token}",
            f"history tokens  {plan.tokens:,} ({plan.pages:,} pages of {args.page_size})",
            f"ratio to bf16   {plan.ratio_to_bf16:.3f}x (bf16 history: {plan.bf16_tokens:,} tokens; "
            f"plain bf16 cache without ring: {plan.plain_bf16_tokens:,}, {plan.ratio_to_plain_bf16:.3f}x)",
        ]
    )


def _table(geo: Geometry, args: argparse.Namespace, budget: int) -> str:
    from kvstrata.quant import list_codecs

    rows = [
        "| codec | cold B/token | history tokens | ratio to bf16 | ratio to plain bf16 |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in list_codecs():
        p = plan_capacity(geo, name, budget, args.page_size, args.recent_window, args.max_running)
        rows.append(
            f"| {name} | {p.cold_bytes_per_token:.1f} | {p.tokens:,} | {p.ratio_to_bf16:.3f}x "
            f"| {p.ratio_to_plain_bf16:.3f}x |"
        )
    return "\n".join(rows)


def run(args: argparse.Namespace) -> int:
    from kvstrata.quant import get_codec

    if args.recent_window % args.page_size:
        raise SystemExit(f"--recent-window {args.recent_window} must be a multiple of --page-size")
    get_codec(args.kv_cache_dtype)
    geo = _resolve_geometry(args)
    budget = math.floor(args.budget_gib * GIB)
    if args.table:
        print(_table(geo, args, budget))
        return 0
    plan = plan_capacity(
        geo, args.kv_cache_dtype, budget, args.page_size, args.recent_window, args.max_running
    )
    if args.json:
        print(json.dumps({**asdict(plan), **asdict(geo)}))
    else:
        print(_text(plan, geo, args))
    return 0
