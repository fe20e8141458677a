"""Model geometry, the one place that reads it from a checkpoint's configuration.

Layers, query heads, KV heads and head dim from a Hugging Face ``config.json`` dict or from GGUF
key/value metadata. It imports nothing of ours, so both the engine (`engine/config.py`, the full
model configuration) and the cache's capacity planner (`radix/capacity.py`) build on it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Geometry:
    layers: int
    kv_heads: int
    head_dim: int
    q_heads: int | None = None  # None where only the KV side matters


def from_hf(config: dict[str, Any]) -> Geometry:
    """From a ``config.json`` dict (a multimodal model's ``text_config`` when it has one)."""
    d = config.get("text_config", config)
    q_heads = d["num_attention_heads"]
    return Geometry(
        layers=d["num_hidden_layers"],
        kv_heads=d.get("num_key_value_heads") or q_heads,
        head_dim=d.get("head_dim") or d["hidden_size"] // q_heads,
        q_heads=q_heads,
    )


def from_gguf(meta: dict[str, Any]) -> Geometry:
    """From GGUF metadata (``general.architecture`` and ``<arch>.*`` keys)."""
    arch = meta.get("general.architecture") or "llama"
    q_heads = meta.get(f"{arch}.attention.head_count")
    layers = meta.get(f"{arch}.block_count")
    if q_heads is None or layers is None:
        raise ValueError(f"GGUF metadata lacks {arch}.block_count or {arch}.attention.head_count")
    head_dim = meta.get(f"{arch}.attention.key_length") or int(meta[f"{arch}.embedding_length"]) // int(
        q_heads
    )
    return Geometry(
        layers=int(layers),
        kv_heads=int(meta.get(f"{arch}.attention.head_count_kv") or q_heads),
        head_dim=int(head_dim),
        q_heads=int(q_heads),
    )
