"""The codec interface and the `Quantized` result every codec returns.

A codec turns a float tensor ``[..., tokens, heads, head_dim]`` into named parts (codes, scales, ...)
that keep the leading dims, and back. Everything about byte layouts lives in the codec subclasses;
this module holds the shared contract (input preparation is in `prepare`).
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from kvstrata.quant.prepare import Prepared, check_input, prepare

GRANULARITIES = ("token", "channel")

PartSpec = dict[str, tuple[tuple[int, ...], torch.dtype]]


@dataclass
class Quantized:
    """A quantized tensor: its parts plus what was counted on the way in.

    ``overflow`` counts finite elements beyond ``static_absmax`` (clipped); ``nonfinite`` counts
    NaN/Inf inputs. Both are zero for dynamic scales on finite data.
    """

    parts: dict[str, torch.Tensor]
    granularity: str
    head_dim: int
    overflow: int = 0
    nonfinite: int = 0

    def nbytes(self) -> int:
        """Exact bytes of every stored part, scales included."""
        return sum(t.numel() * t.element_size() for t in self.parts.values())


class Codec(ABC):
    """Base class of all codecs. Subclasses define the byte layout via `page_parts`.

    ``quantize`` accepts ``[..., tokens, heads, head_dim]``; ``dequantize_parts`` works on parts with
    any leading dims, e.g. gathered from a page pool as ``{name: buf[name][page_ids]}``.
    """

    name: str = ""

    @abstractmethod
    def quantize(
        self,
        x: torch.Tensor,
        granularity: str = "token",
        static_absmax: torch.Tensor | None = None,
    ) -> Quantized:
        """Quantize ``x``; ``static_absmax`` (broadcastable to the scale shape) clips and fixes scales."""

    def dequantize(self, q: Quantized, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Decode a `Quantized` back to a float tensor of the original shape."""
        return self.dequantize_parts(q.parts, q.granularity, q.head_dim, dtype)

    @abstractmethod
    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        """Decode raw parts (any leading dims) to ``[..., tokens, heads, head_dim]`` in ``dtype``."""

    @abstractmethod
    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        """``{name: (shape, dtype)}`` of one page's parts; a pool allocates ``(num_pages, *shape)``."""

    def page_bytes(self, page_size: int, heads: int, head_dim: int, granularity: str) -> int:
        """Exact bytes of one page, scales included."""
        specs = self.page_parts(page_size, heads, head_dim, granularity).values()
        return sum(math.prod(shape) * dtype.itemsize for shape, dtype in specs)

    def bytes_per_token(self, heads: int, head_dim: int) -> int:
        """Exact stored bytes per token at token granularity, scales included."""
        return self.page_bytes(1, heads, head_dim, "token")

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


class ScaledCodec(Codec):
    """A codec with scales: shared input preparation (NaN/Inf policy, static clip), then `_encode`."""

    def quantize(
        self,
        x: torch.Tensor,
        granularity: str = "token",
        static_absmax: torch.Tensor | None = None,
    ) -> Quantized:
        check_granularity(granularity)
        check_input(x)
        self._check_geometry(x.shape[-3], x.shape[-1], granularity)
        prepared = prepare(x, granularity, static_absmax)
        return Quantized(
            parts=self._encode(prepared, granularity),
            granularity=granularity,
            head_dim=x.shape[-1],
            overflow=prepared.overflow,
            nonfinite=prepared.nonfinite,
        )

    @abstractmethod
    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        """Encode prepared (finite, clipped) data into parts."""

    def _check_geometry(self, tokens: int, head_dim: int, granularity: str) -> None:
        """Raise ``ValueError`` for shapes this codec cannot store; the default accepts any."""


def check_granularity(granularity: str) -> None:
    if granularity not in GRANULARITIES:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")


def scale_shape(page_size: int, heads: int, head_dim: int, granularity: str) -> tuple[int, int, int]:
    """Shape of one page's per-token (``[P, H, 1]``) or per-channel (``[1, H, D]``) scales."""
    check_granularity(granularity)
    return (page_size, heads, 1) if granularity == "token" else (1, heads, head_dim)
