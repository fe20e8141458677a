"""Per-layer sensitivity (quantize one layer at a time) and the per-layer precision plan it leads to.

Sensitivity configurations keep every layer unquantized except one, which gets the probe codec with
the probe window (0 by default: the whole history of that layer quantized, the strongest signal for a
short run). Layers are ranked by mean KL(reference || quantized), far less noisy than perplexity.
The plan starts from the low codec on every layer and raises the most sensitive layers to the high
codec, in rank order, while the plan's bytes per token stay within the budget.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstrata.eval.configs import EvalConfig
from kvstrata.eval.stats import WindowScore, summarize


@dataclass(frozen=True)
class LayerSensitivity:
    layer: int
    kl: float
    drift_pct: float
    top1_agreement: float

    def to_json(self) -> dict[str, float | int]:
        return {
            "layer": self.layer,
            "kl": self.kl,
            "drift_pct": self.drift_pct,
            "top1_agreement": self.top1_agreement,
        }


def probe_configs(num_layers: int, codec: str, window: int) -> list[EvalConfig]:
    """One configuration per layer: that layer in ``codec``, the others unquantized (fp32)."""
    out = []
    for layer in range(num_layers):
        codecs = ["fp32"] * num_layers
        codecs[layer] = codec
        out.append(EvalConfig(f"{codec}@layer{layer}", tuple(codecs), window, False, False))
    return out


def rank_layers(per_layer: Sequence[Sequence[WindowScore]]) -> list[LayerSensitivity]:
    """Layers sorted by mean KL, most sensitive first (``per_layer[i]`` = the window scores of layer i)."""
    out = []
    for layer, scores in enumerate(per_layer):
        s = summarize(scores, resamples=200)
        out.append(LayerSensitivity(layer, s.kl, s.drift_pct, s.top1_agreement))
    return sorted(out, key=lambda x: x.kl, reverse=True)


def make_plan(
    ranking: Sequence[LayerSensitivity],
    low: str,
    high: str,
    budget_bytes: float,
    plan_bytes: Callable[[list[str]], float],
) -> list[str]:
    """Per-layer codecs: ``low`` everywhere, then ``high`` for the most sensitive layers within budget."""
    codecs = [low] * len(ranking)
    if plan_bytes(codecs) > budget_bytes:
        raise ValueError(
            f"even {low} on every layer ({plan_bytes(codecs):.0f} B/token) is over the plan budget "
            f"({budget_bytes:.0f} B/token); raise --plan-budget or pick a smaller --sensitivity-codec"
        )
    for entry in ranking:
        trial = list(codecs)
        trial[entry.layer] = high
        if plan_bytes(trial) > budget_bytes:
            break
        codecs = trial
    return codecs


def plan_document(
    codecs: list[str],
    ranking: Sequence[LayerSensitivity],
    window: int,
    rotation: bool,
    sinks: bool,
    page_size: int,
    bytes_per_token: float,
    bf16_bytes_per_token: float,
    model: str,
) -> dict[str, Any]:
    """The plan file: ``layer_codecs`` is what the engine reads; the rest documents the choice."""
    return {
        "layer_codecs": codecs,
        "recent_window": window,
        "rotation": rotation,
        "sinks": sinks,
        "page_size": page_size,
        "bytes_per_token": bytes_per_token,
        "bf16_bytes_per_token": bf16_bytes_per_token,
        "ratio_to_bf16": bytes_per_token / bf16_bytes_per_token,
        "model": model,
        "sensitivity": [r.to_json() for r in ranking],
    }
