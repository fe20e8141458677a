"""Raw storage codecs (`bf16`, `fp32`): no scales, no quantization, the unquantized baseline.

Values are stored as a plain cast, so NaN/Inf pass through unchanged (they are still counted) and
``static_absmax`` is ignored: there is nothing to clip for, so ``overflow`` stays 0.
"""

from __future__ import annotations

import torch

from kvstrata.quant.codec import Codec, PartSpec, Quantized, check_granularity
from kvstrata.quant.prepare import check_input
from kvstrata.quant.registry import register


class RawCodec(Codec):
    """Stores ``x.to(storage_dtype)`` as the single part ``"values"``."""

    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype

    def quantize(
        self,
        x: torch.Tensor,
        granularity: str = "token",
        static_absmax: torch.Tensor | None = None,
    ) -> Quantized:
        check_granularity(granularity)
        check_input(x)
        nonfinite = int(x.numel() - torch.isfinite(x).sum().item())
        return Quantized(
            parts={"values": x.to(self.storage_dtype)},
            granularity=granularity,
            head_dim=x.shape[-1],
            nonfinite=nonfinite,
        )

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        return parts["values"].to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        check_granularity(granularity)
        return {"values": ((page_size, heads, head_dim), self.storage_dtype)}


register(RawCodec("bf16", torch.bfloat16))
register(RawCodec("fp32", torch.float32))
