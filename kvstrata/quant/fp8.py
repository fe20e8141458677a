"""FP8 codecs `fp8_e4m3` (max 448) and `fp8_e5m2` (max 57344) with a float32 scale per group.

Layout per page (token granularity; channel granularity swaps the scale shape to ``[1, H, D]``):
``codes`` ``[P, H, D]`` in the torch float8 dtype, ``scale`` ``[P, H, 1]`` float32 with
``scale = absmax / fp8_max``. Encoding clamps to ``±fp8_max`` before the cast (round to nearest
even), so no code is ever NaN/Inf whatever the backend's cast does out of range.
"""

from __future__ import annotations

import torch

from kvstrata.quant.affine import safe_divisor
from kvstrata.quant.codec import PartSpec, ScaledCodec, scale_shape
from kvstrata.quant.registry import register
from kvstrata.quant.stats import Prepared


class Fp8Codec(ScaledCodec):
    def __init__(self, name: str, storage_dtype: torch.dtype) -> None:
        self.name = name
        self.storage_dtype = storage_dtype
        self.fmax = float(torch.finfo(storage_dtype).max)

    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        scale = p.absmax / self.fmax
        y = (p.x / safe_divisor(scale)).clamp_(-self.fmax, self.fmax)
        return {"codes": y.to(self.storage_dtype), "scale": scale}

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        return (parts["codes"].to(torch.float32) * parts["scale"]).to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        return {
            "codes": ((page_size, heads, head_dim), self.storage_dtype),
            "scale": (scale_shape(page_size, heads, head_dim, granularity), torch.float32),
        }


register(Fp8Codec("fp8_e4m3", torch.float8_e4m3fn))
register(Fp8Codec("fp8_e5m2", torch.float8_e5m2))
