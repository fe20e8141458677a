"""Codecs by name. Each codec family module registers its (stateless) instances when imported."""

from __future__ import annotations

from kvstrata.quant.codec import Codec

_REGISTRY: dict[str, Codec] = {}


class UnknownCodecError(KeyError, ValueError):
    """An unknown codec name; catchable as either `KeyError` or `ValueError`."""

    def __str__(self) -> str:
        return str(self.args[0])


def register(codec: Codec) -> Codec:
    """Register ``codec`` under ``codec.name``; a name can be registered once."""
    if not codec.name:
        raise ValueError("a codec needs a non-empty name")
    if codec.name in _REGISTRY:
        raise ValueError(f"codec {codec.name!r} is already registered")
    _REGISTRY[codec.name] = codec
    return codec


def list_codecs() -> list[str]:
    """Names of all registered codecs, sorted."""
    return sorted(_REGISTRY)


def get_codec(name: str) -> Codec:
    """The codec registered as ``name``; raises `UnknownCodecError` listing the valid names."""
    try:
        return _REGISTRY[name]
    except KeyError:
        raise UnknownCodecError(f"unknown codec {name!r}; valid codecs: {', '.join(list_codecs())}") from None
