"""`PluginOptions`: kvstrata's settings inside SGLang, read from ``KVSTRATA_*`` environment variables.

SGLang's CLI accepts only its own flags and ``--kv-cache-dtype`` only its own values, so kvstrata's
choices travel through the environment, which SGLang's scheduler subprocesses inherit. SGLang's
own ``--kv-cache-dtype`` keeps working: kvstrata's pool replaces the BF16 pool only when the
``kvstrata`` radix cache is selected and ``KVSTRATA_KV_CODEC`` names a kvstrata codec. With
``KVSTRATA_KV_CODEC=auto`` nothing is quantized by kvstrata: SGLang keeps its own pool (any of its
``--kv-cache-dtype`` values) and its own attention backends, so the model's output is SGLang's to the
bit, and the ``kvstrata`` radix cache adds only pinned prefixes and its metrics.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvstrata.quant import get_codec
from kvstrata.quant.registry import UnknownCodecError

ENV_CODEC = "KVSTRATA_KV_CODEC"
ENV_WINDOW = "KVSTRATA_RECENT_WINDOW"
ENV_PIN_BUDGET = "KVSTRATA_PIN_BUDGET_BYTES"
ENV_PIN_MULTIMODAL = "KVSTRATA_PIN_MULTIMODAL"
SGLANG_POOL = "auto"  # KVSTRATA_KV_CODEC value: SGLang's own pool and attention, no strata


@dataclass(frozen=True)
class PluginOptions:
    """``codec``: history codec of every layer, or ``auto`` (`SGLANG_POOL`: SGLang's own pool and
    attention); ``recent_window``: BF16 tokens kept per request (a multiple of the page size);
    ``pin_budget_bytes``: cap on pinned cold bytes (None: a quarter of the pool);
    ``pin_multimodal``: pin the prefix ending at each image's pad-token span."""

    codec: str = "fp8_e4m3"
    recent_window: int = 128
    pin_budget_bytes: int | None = None
    pin_multimodal: bool = True

    def __post_init__(self) -> None:
        if self.codec != SGLANG_POOL:
            try:
                get_codec(self.codec)
            except UnknownCodecError as exc:
                raise ValueError(f"{ENV_CODEC}: {exc}, or {SGLANG_POOL} (SGLang's own pool)") from None
        if self.recent_window < 0:
            raise ValueError(f"{ENV_WINDOW} must be >= 0, got {self.recent_window}")
        if self.pin_budget_bytes is not None and self.pin_budget_bytes < 0:
            raise ValueError(f"{ENV_PIN_BUDGET} must be >= 0, got {self.pin_budget_bytes}")

    @property
    def stratified(self) -> bool:
        """Whether kvstrata's stratified pool replaces SGLang's (every codec but ``auto``)."""
        return self.codec != SGLANG_POOL

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> PluginOptions:
        env = dict(os.environ) if env is None else env
        budget = env.get(ENV_PIN_BUDGET)
        return cls(
            codec=env.get(ENV_CODEC, cls.codec),
            recent_window=int(env.get(ENV_WINDOW, cls.recent_window)),
            pin_budget_bytes=None if budget is None else int(budget),
            pin_multimodal=env.get(ENV_PIN_MULTIMODAL, "1") not in ("0", "false", "no"),
        )
