"""Quantization codecs, rotation, scales files and overflow accounting. Imports nothing else of ours.

``get_codec(name)`` returns a stateless `Codec`; ``codec.quantize(x, granularity, static_absmax)``
gives a `Quantized` whose ``parts`` a page pool stores as laid out by ``codec.page_parts``.
Byte layouts, scale modes and the NaN/Inf policy are described in ``docs/quant.md``.
"""

from kvstrata.quant import fp4, fp8, int4, int8, raw  # noqa: F401  (importing registers the codecs)
from kvstrata.quant.codec import GRANULARITIES, Codec, PartSpec, Quantized, ScaledCodec
from kvstrata.quant.error import relative_rmse
from kvstrata.quant.registry import UnknownCodecError, get_codec, list_codecs, register
from kvstrata.quant.rotation import hadamard_rotate
from kvstrata.quant.scales import ScalesFile, ScaleStats

__all__ = [
    "GRANULARITIES",
    "Codec",
    "PartSpec",
    "Quantized",
    "ScaleStats",
    "ScaledCodec",
    "ScalesFile",
    "UnknownCodecError",
    "get_codec",
    "hadamard_rotate",
    "list_codecs",
    "register",
    "relative_rmse",
]
