"""The KV configuration kvstrata ships, per history codec, and the per-layer plan file.

Chosen with the accuracy lab (`kvstrata eval`, docs/eval.md): SmolLM2-135M-Instruct over 32,768
tokens of Wikipedia summaries at context 1024 and 4096, plus a copy of it with planted outlier key
channels. Keys are stored with per-page per-channel scales, values per token. The engine and the lab
both read this table, so what is served is what was measured.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# fp8_e4m3 history with a 128-token BF16 window and sinks measured -0.000% perplexity drift
# (95% CI [-0.026, +0.027]), KL 1.8e-4, at 0.52x the bytes per token of BF16.
DEFAULT_KV_CACHE_DTYPE = "fp8_e4m3"


@dataclass(frozen=True)
class Defaults:
    recent_window: int
    rotation: bool
    sinks: bool


SHIPPED_DEFAULTS: dict[str, Defaults] = {
    "auto": Defaults(recent_window=0, rotation=False, sinks=False),
    "fp32": Defaults(recent_window=0, rotation=False, sinks=False),
    "bf16": Defaults(recent_window=0, rotation=False, sinks=False),
    "fp8_e4m3": Defaults(recent_window=128, rotation=False, sinks=True),
    "fp8_e5m2": Defaults(recent_window=128, rotation=False, sinks=True),
    "int8": Defaults(recent_window=128, rotation=False, sinks=True),
    "int8_asym": Defaults(recent_window=128, rotation=False, sinks=True),
    "int4": Defaults(recent_window=128, rotation=False, sinks=True),
    "fp4_e2m1": Defaults(recent_window=256, rotation=False, sinks=True),
}
# A per-layer plan mixes codecs down to fp4: it gets the widest window the lab measured for it.
PLAN_DEFAULTS = Defaults(recent_window=512, rotation=False, sinks=True)


def is_plan_path(kv_cache_dtype: str) -> bool:
    """`--kv-cache-dtype plan.json` names a per-layer plan written by `kvstrata eval --emit-plan`."""
    return kv_cache_dtype.endswith(".json")


def read_plan_file(path: str | Path) -> dict[str, object]:
    """A plan file: ``{"layer_codecs": [...], "recent_window"?, "rotation"?, "sinks"?, ...}``.

    Also accepted: a bare JSON list of codec names, and ``{"layers": [name | {"codec": name}, ...]}``.
    An entry ``{"k": name, "v": name}`` stores the layer's keys and values in different codecs (read
    as the layer codec ``"k/v"``).
    """
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read layer plan {path}: {exc}") from exc
    if isinstance(data, list):
        data = {"layer_codecs": data}
    if not isinstance(data, dict):
        raise ValueError(f"layer plan {path} holds no list of layer codecs")
    items = data.get("layer_codecs", data.get("layers"))
    if not isinstance(items, list) or not items:
        raise ValueError(f"layer plan {path} holds no list of layer codecs")
    codecs = []
    for item in items:
        if isinstance(item, dict) and "k" in item and "v" in item:
            item = f"{item['k']}/{item['v']}"
        name = item.get("codec") if isinstance(item, dict) else item
        if not isinstance(name, str):
            raise ValueError(f"layer plan {path}: bad entry {item!r}")
        codecs.append(name)
    return {**data, "layer_codecs": codecs}


def plan_defaults(plan: dict[str, object]) -> Defaults:
    """The window, rotation and sinks a plan file asks for, `PLAN_DEFAULTS` where it is silent."""
    return Defaults(
        int(plan.get("recent_window", PLAN_DEFAULTS.recent_window)),  # type: ignore[arg-type]
        bool(plan.get("rotation", PLAN_DEFAULTS.rotation)),
        bool(plan.get("sinks", PLAN_DEFAULTS.sinks)),
    )


def codec_defaults(kv_cache_dtype: str) -> Defaults:
    """Shipped defaults of one history codec; a codec not in the table gets the fp8 ones."""
    return SHIPPED_DEFAULTS.get(kv_cache_dtype, SHIPPED_DEFAULTS["fp8_e4m3"])
