"""The lab's output: one JSON document (schema of issue 7) and a rich table in the terminal."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstrata.eval.configs import EvalConfig
from kvstrata.eval.stats import Summary

RESULT_KEYS = (
    "kv_cache_dtype",
    "recent_window",
    "rotation",
    "sinks",
    "perplexity",
    "drift_pct",
    "drift_ci95",
    "kl",
    "top1_agreement",
    "bytes_per_token",
)
TOP_KEYS = ("model", "corpus", "tokens", "results")


@dataclass(frozen=True)
class ConfigResult:
    config: EvalConfig
    summary: Summary
    bytes_per_token: float  # cold-tier bytes per token of history, all layers, K+V, scales included
    ring_bytes_per_seq: int  # the BF16 recent ring of one sequence, all layers (a fixed cost)

    def to_json(self) -> dict[str, Any]:
        c, s = self.config, self.summary
        out: dict[str, Any] = {
            "kv_cache_dtype": c.kv_cache_dtype,
            "recent_window": c.recent_window,
            "rotation": "hadamard" if c.rotation else "off",
            "sinks": c.sinks,
            "perplexity": s.perplexity,
            "drift_pct": s.drift_pct,
            "drift_ci95": [s.drift_ci95[0], s.drift_ci95[1]],
            "kl": s.kl,
            "top1_agreement": s.top1_agreement,
            "bytes_per_token": self.bytes_per_token,
            "label": c.label,
            "ring_bytes_per_seq": self.ring_bytes_per_seq,
        }
        if c.layer_codecs is not None:
            out["layer_codecs"] = list(c.layer_codecs)
        return out


def build_document(
    model: str, corpus: str, tokens: int, results: list[ConfigResult], **extra: Any
) -> dict[str, Any]:
    doc: dict[str, Any] = {"model": model, "corpus": corpus, "tokens": tokens}
    doc["results"] = [r.to_json() for r in results]
    doc.update(extra)
    validate_document(doc)
    return doc


def validate_document(doc: dict[str, Any]) -> None:
    """Raise ``ValueError`` if ``doc`` does not follow the issue-7 schema."""
    for key in TOP_KEYS:
        if key not in doc:
            raise ValueError(f"results document lacks {key!r}")
    if not isinstance(doc["tokens"], int) or doc["tokens"] <= 0:
        raise ValueError("'tokens' must be a positive int")
    for i, r in enumerate(doc["results"]):
        missing = [k for k in RESULT_KEYS if k not in r]
        if missing:
            raise ValueError(f"result {i} lacks {missing}")
        lo, hi = r["drift_ci95"]
        numbers = [
            r["perplexity"],
            r["drift_pct"],
            lo,
            hi,
            r["kl"],
            r["top1_agreement"],
            r["bytes_per_token"],
        ]
        if not all(isinstance(x, int | float) and math.isfinite(x) for x in numbers):
            raise ValueError(f"result {i} has a non-finite number: {r}")
        if not 0.0 <= r["top1_agreement"] <= 1.0:
            raise ValueError(f"result {i}: top1_agreement outside [0, 1]")


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def render_table(doc: dict[str, Any], bf16_bytes_per_token: float) -> Any:
    """A rich Table of the results (import of rich kept here, not at package import)."""
    from rich.table import Table

    table = Table(
        title=f"{doc['model']} · {doc['tokens']} tokens · context {doc.get('context', '?')}",
        caption="drift = perplexity vs the unquantized reference, paired 95% bootstrap interval",
    )
    for col in ("config", "perplexity", "drift %", "95% CI", "KL", "top-1", "bytes/token", "x BF16"):
        table.add_column(col, justify="left" if col == "config" else "right")
    for r in doc["results"]:
        lo, hi = r["drift_ci95"]
        table.add_row(
            r.get("label", r["kv_cache_dtype"]),
            f"{r['perplexity']:.4f}",
            f"{r['drift_pct']:+.3f}",
            f"[{lo:+.3f}, {hi:+.3f}]",
            f"{r['kl']:.2e}",
            f"{r['top1_agreement'] * 100:.2f}%",
            f"{r['bytes_per_token']:.0f}",
            f"{r['bytes_per_token'] / bf16_bytes_per_token:.3f}",
        )
    return table


def markdown_table(doc: dict[str, Any], bf16_bytes_per_token: float) -> str:
    """The same table in Markdown, for docs/eval.md."""
    lines = [
        "| config | perplexity | drift % | 95% CI | KL | top-1 | bytes/token | x BF16 |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in doc["results"]:
        lo, hi = r["drift_ci95"]
        lines.append(
            f"| {r.get('label', r['kv_cache_dtype'])} | {r['perplexity']:.4f} | {r['drift_pct']:+.3f} | "
            f"[{lo:+.3f}, {hi:+.3f}] | {r['kl']:.2e} | {r['top1_agreement'] * 100:.2f}% | "
            f"{r['bytes_per_token']:.0f} | {r['bytes_per_token'] / bf16_bytes_per_token:.3f} |"
        )
    return "\n".join(lines)
