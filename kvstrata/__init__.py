"""kvstrata: LLM serving with a stratified KV cache (BF16 recent window over quantized history)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from kvstrata.engine.engine import Engine

__all__ = ["Engine", "__version__"]


def __getattr__(name: str) -> Any:
    # Lazy so that `import kvstrata` (and `kvstrata --help`) does not pay for torch and transformers.
    if name == "Engine":
        from kvstrata.engine.engine import Engine

        return Engine
    raise AttributeError(f"module 'kvstrata' has no attribute {name!r}")
