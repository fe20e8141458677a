"""Which KV configurations a lab run measures: parsing the CLI grid and the shipped defaults.

A configuration is a per-layer history codec plan plus the BF16 recent window, rotation and sinks.
A codec given by name alone uses the shipped defaults for the rest (``SHIPPED_DEFAULTS``: chosen
with this lab, see docs/eval.md); ``--recent-window/--rotation/--sinks`` turn it into a sweep.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstrata.engine.defaults import (
    PLAN_DEFAULTS,
    SHIPPED_DEFAULTS,
    Defaults,
    is_plan_path,
    plan_defaults,
    read_plan_file,
)
from kvstrata.engine.kvplan import centers_of
from kvstrata.radix.pool import split_layer_codec

__all__ = ["PLAN_DEFAULTS", "SHIPPED_DEFAULTS", "Defaults", "EvalConfig", "build_grid", "load_plan"]

REFERENCE = "auto"  # unquantized: fp32 storage in the ring and the cold pages, fp32 compute
UNQUANTIZED = ("auto", "bf16", "fp32")
ALL_CODECS = ("auto", "bf16", "fp8_e4m3", "fp8_e5m2", "int8", "int4", "fp4_e2m1")


@dataclass(frozen=True)
class EvalConfig:
    """One measured configuration. ``kv_cache_dtype`` is a codec name, ``auto`` or a plan file path."""

    kv_cache_dtype: str
    layer_codecs: tuple[str, ...] | None  # None: kv_cache_dtype on every layer
    recent_window: int
    rotation: bool
    sinks: bool
    extra: dict[str, object] = field(default_factory=dict, compare=False, hash=False)
    # [L, Hkv, D] subtracted from every key before it enters the cache (a plan's key centering)
    key_centers: Any = field(default=None, compare=False, hash=False)

    @property
    def label(self) -> str:
        name = Path(self.kv_cache_dtype).name if self.layer_codecs is not None else self.kv_cache_dtype
        if self.kv_cache_dtype in UNQUANTIZED:
            return name
        parts = [name, f"w{self.recent_window}"]
        if self.rotation:
            parts.append("hadamard")
        if self.sinks:
            parts.append("sinks")
        return " ".join(parts)

    def codecs(self, num_layers: int) -> list[str]:
        """Per-layer cold codec names for the cache (``auto`` stores fp32)."""
        if self.layer_codecs is not None:
            if len(self.layer_codecs) != num_layers:
                raise ValueError(
                    f"plan {self.kv_cache_dtype} has {len(self.layer_codecs)} layers, model has {num_layers}"
                )
            return list(self.layer_codecs)
        codec = "fp32" if self.kv_cache_dtype == REFERENCE else self.kv_cache_dtype
        return [codec] * num_layers


def parse_list(text: str, what: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise ValueError(f"{what}: empty list")
    return items


def parse_bool_list(text: str, what: str, on: tuple[str, ...]) -> list[bool]:
    off = ("off", "false", "no", "0", "none")
    out = []
    for item in parse_list(text, what):
        low = item.lower()
        if low in on:
            out.append(True)
        elif low in off:
            out.append(False)
        else:
            raise ValueError(f"{what}: {item!r} is not one of {', '.join(off + on)}")
    return out


def load_plan(path: str | Path) -> dict[str, object]:
    """Read a plan file written by ``--emit-plan`` (``{"layer_codecs": [...], ...}``)."""
    return read_plan_file(path)


def build_grid(
    names: list[str],
    windows: list[int] | None,
    rotations: list[bool] | None,
    sinks: list[bool] | None,
    known_codecs: list[str],
) -> list[EvalConfig]:
    """The configurations to measure, reference first, without duplicates, in the given order."""
    out: list[EvalConfig] = [EvalConfig(REFERENCE, None, 0, False, False)]
    for name in names:
        plan = None
        if is_plan_path(name):
            plan = load_plan(name)
            base = plan_defaults(plan)
            for layer_codec in plan["layer_codecs"]:  # type: ignore[union-attr]
                for codec in split_layer_codec(layer_codec):
                    if codec not in known_codecs:
                        raise ValueError(
                            f"plan {name}: unknown codec {codec!r}; known: {', '.join(known_codecs)}"
                        )
        elif name in UNQUANTIZED:
            if name != REFERENCE:
                out.append(EvalConfig(name, None, 0, False, False))
            continue
        elif name not in known_codecs:
            raise ValueError(
                f"unknown config {name!r}; known: auto, {', '.join(known_codecs)}, or a plan .json"
            )
        else:
            base = SHIPPED_DEFAULTS.get(name, PLAN_DEFAULTS)
        layer_codecs = tuple(plan["layer_codecs"]) if plan is not None else None  # type: ignore[arg-type]
        centers = centers_of(plan) if plan is not None else None
        for w in windows if windows is not None else [base.recent_window]:
            for r in rotations if rotations is not None else [base.rotation]:
                for s in sinks if sinks is not None else [base.sinks]:
                    out.append(EvalConfig(name, layer_codecs, w, r, s, key_centers=centers))
    seen: set[EvalConfig] = set()
    unique = []
    for cfg in out:
        if cfg not in seen:
            seen.add(cfg)
            unique.append(cfg)
    return unique
