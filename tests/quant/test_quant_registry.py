from __future__ import annotations

import pytest
import torch

import kvstrata.quant as quant
from kvstrata.quant import Codec, Quantized, get_codec, list_codecs


def test_registered_names():
    assert list_codecs() == ["bf16", "fp32", "fp4_e2m1", "fp8_e4m3", "fp8_e5m2", "int4", "int8", "int8_asym"]


@pytest.mark.parametrize("exc", [KeyError, ValueError])
def test_unknown_name_lists_valid_names(exc: type[Exception]):
    with pytest.raises(exc) as info:
        get_codec("int3")
    message = str(info.value)
    assert "unknown codec 'int3'" in message
    for name in list_codecs():
        assert name in message


def test_get_codec_returns_named_codec():
    for name in list_codecs():
        codec = get_codec(name)
        assert isinstance(codec, Codec) and codec.name == name


def test_public_exports():
    for name in ("get_codec", "list_codecs", "Quantized", "Codec"):
        assert name in quant.__all__
    assert Quantized.__dataclass_fields__.keys() >= {
        "parts",
        "granularity",
        "head_dim",
        "overflow",
        "nonfinite",
    }


def test_bad_granularity():
    with pytest.raises(ValueError, match="granularity must be one of"):
        get_codec("int8").quantize(torch.zeros(1, 1, 4), granularity="page")
