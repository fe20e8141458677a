"""`int4`: asymmetric (min/max) 4-bit integers, two codes per byte.

Layout per page (token granularity; channel granularity swaps the scale shape to ``[1, H, D]``):
``codes`` ``[P, H, D/2]`` uint8 (see `nibbles`), ``scale`` and ``offset`` ``[P, H, 1]`` float32.
Decoding: ``code * scale + offset`` with code in ``[0, 15]``.
"""

from __future__ import annotations

import torch

from kvstrata.quant.affine import asymmetric_encode
from kvstrata.quant.codec import PartSpec, ScaledCodec, scale_shape
from kvstrata.quant.nibbles import check_even, pack, unpack
from kvstrata.quant.prepare import Prepared
from kvstrata.quant.registry import register

LEVELS = 15


class Int4Codec(ScaledCodec):
    name = "int4"

    def _check_geometry(self, tokens: int, head_dim: int, granularity: str) -> None:
        check_even(head_dim, self.name)

    def _encode(self, p: Prepared, granularity: str) -> dict[str, torch.Tensor]:
        codes, scale, offset = asymmetric_encode(p, granularity, LEVELS)
        return {"codes": pack(codes), "scale": scale, "offset": offset}

    def dequantize_parts(
        self,
        parts: dict[str, torch.Tensor],
        granularity: str,
        head_dim: int,
        dtype: torch.dtype = torch.float32,
    ) -> torch.Tensor:
        codes = unpack(parts["codes"]).to(torch.float32)
        return (codes * parts["scale"] + parts["offset"]).to(dtype)

    def page_parts(self, page_size: int, heads: int, head_dim: int, granularity: str) -> PartSpec:
        check_even(head_dim, self.name)
        sshape = scale_shape(page_size, heads, head_dim, granularity)
        return {
            "codes": ((page_size, heads, head_dim // 2), torch.uint8),
            "scale": (sshape, torch.float32),
            "offset": (sshape, torch.float32),
        }


register(Int4Codec())
