"""`CacheConfig`: the geometry, precision plan and capacities of one stratified cache."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CacheConfig:
    """Geometry and precision plan of a `StratifiedKVCache`.

    Capacities: ``num_pages`` cold pages, or as many as ``cold_budget_bytes`` holds when
    ``num_pages`` is None. ``max_running`` ring slots of ``max_recent_window + page_size`` tokens
    per layer. ``recent_window`` (default: ``max_recent_window``) is the BF16 window in use now; the
    precision-fallback hook `StratifiedKVCache.set_recent_window` widens it up to
    ``max_recent_window`` without allocating. ``pin_budget_bytes`` caps pinned cold bytes (default:
    a quarter of the cold pool). With ``sinks``, a sequence's first page is also kept in
    ``ring_dtype`` in one of ``sink_pages`` sink pages (default ``2 * max_running``).

    Image pages: with ``image_codec`` set, a completed page holding a token id ``>= image_token_from``
    (image placeholders carry pad ids past the vocabulary) is stored in a second pool of
    ``image_pages`` pages in ``image_codec`` (every layer, keys and values), whatever the layer's
    text codec (``--vision-kv-dtype``).

    Raised pages: with ``raised_codecs`` set (one layer codec per layer, wider than ``layer_codecs``), a
    third pool of ``raised_pages`` pages stores the text pages completed while the cache is raised
    (`StratifiedKVCache.set_raised`, driven by the drift monitor); pages keep the pool they were
    written in.
    """

    num_layers: int
    kv_heads: int
    head_dim: int
    page_size: int = 16
    recent_window: int = 128
    layer_codecs: list[str] = field(default_factory=list)
    ring_dtype: torch.dtype = torch.bfloat16
    num_pages: int | None = None
    max_running: int = 8
    sinks: bool = False
    rotation: bool = False
    scales: Any = None
    device: str | torch.device = "cpu"
    max_recent_window: int | None = None
    cold_budget_bytes: int | None = None
    pin_budget_bytes: int | None = None
    sink_pages: int | None = None
    block_pages: int = 64
    image_codec: str | None = None
    image_pages: int = 0
    image_token_from: int | None = None
    raised_codecs: list[str] | None = None
    raised_pages: int = 0

    def __post_init__(self) -> None:
        if not self.layer_codecs:
            self.layer_codecs = ["fp8_e4m3"] * self.num_layers
        if self.max_recent_window is None:
            self.max_recent_window = self.recent_window
        if self.sink_pages is None:
            self.sink_pages = 2 * self.max_running if self.sinks else 0
        self.validate()

    def validate(self) -> None:
        """Raise ``ValueError`` naming the first inconsistent field."""
        for name in ("num_layers", "kv_heads", "head_dim", "page_size", "max_running", "block_pages"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"CacheConfig.{name} must be >= 1, got {getattr(self, name)}")
        if len(self.layer_codecs) != self.num_layers:
            raise ValueError(
                f"CacheConfig.layer_codecs has {len(self.layer_codecs)} entries for {self.num_layers} layers"
            )
        assert self.max_recent_window is not None
        for name in ("recent_window", "max_recent_window"):
            value = getattr(self, name)
            if value < 0 or value % self.page_size:
                raise ValueError(
                    f"CacheConfig.{name}={value} must be a non-negative multiple of "
                    f"page_size={self.page_size}"
                )
        if self.recent_window > self.max_recent_window:
            raise ValueError(
                f"recent_window={self.recent_window} exceeds max_recent_window={self.max_recent_window}"
            )
        if self.num_pages is None and self.cold_budget_bytes is None:
            raise ValueError("CacheConfig needs num_pages or cold_budget_bytes")
        if self.image_codec is not None and (self.image_token_from is None or self.image_pages < 1):
            raise ValueError("CacheConfig.image_codec needs image_token_from and image_pages >= 1")
        if self.raised_codecs is not None and (
            len(self.raised_codecs) != self.num_layers or self.raised_pages < 1
        ):
            raise ValueError(
                f"CacheConfig.raised_codecs needs {self.num_layers} entries and raised_pages >= 1, got "
                f"{len(self.raised_codecs)} entries and {self.raised_pages} pages"
            )
        if self.num_pages is not None and self.num_pages < 0:
            raise ValueError(f"CacheConfig.num_pages must be >= 0, got {self.num_pages}")

    @property
    def ring_tokens(self) -> int:
        """Tokens per layer in one ring slot: the largest window plus one page being filled."""
        assert self.max_recent_window is not None
        return self.max_recent_window + self.page_size
