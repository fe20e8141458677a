"""8-bit integer codecs: `int8` (symmetric, codes in [-127, 127]) and `int8_asym` (min/max, [0, 255]).

Layout per page (token granularity; channel granularity swaps the scale shape to ``[1, H, D]``):
``codes`` ``[P, H, D]`` int8/uint8, ``scale`` ``[P, H, 1]`` float32, plus ``offset`` ``[P, H, 1]``
float32 for `int8_asym`.
"""

from __future__ import annotations

import torch

from kvstrata.quant.affine import asymmetric_encode, symmetric_encode
from kvstrata.quant.codec import PartSpec, ScaledCodec, scale_shape
from kvstrata.quant.prepare import Prepared
from kvstrata.quant.registry import register


class Int8Codec(ScaledCodec):
    """Symmetric int8 by default; ``asymmetric=True`` stores uint8 codes with a float32 offset."""

    def __init__(self, asymmetric: bool = False) -> None:
        self.asymmetric = asymmetric
        self.name = "int8_asym" if asymmetric else "int8"

    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        if self.asymmetric:
            codes, scale, offset = asymmetric_encode(p, granularity, 255)
            return {"codes": codes.to(torch.uint8), "scale": scale, "offset": offset}
        codes, scale = symmetric_encode(p, 127)
        return {"codes": codes.to(torch.int8), "scale": scale}

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        y = parts["codes"].to(torch.float32) * parts["scale"]
        if self.asymmetric:
            y = y + parts["offset"]
        return y.to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        sshape = scale_shape(page_size, heads, head_dim, granularity)
        code_dtype = torch.uint8 if self.asymmetric else torch.int8
        spec: PartSpec = {
            "codes": ((page_size, heads, head_dim), code_dtype),
            "scale": (sshape, torch.float32),
        }
        if self.asymmetric:
            spec["offset"] = (sshape, torch.float32)
        return spec


register(Int8Codec())
register(Int8Codec(asymmetric=True))
