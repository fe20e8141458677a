"""A layer may store keys and values in different codecs (``"int4/fp4_e2m1"``): bytes and values."""

from __future__ import annotations

import pytest
import torch

from kvstrata.quant import get_codec
from kvstrata.radix.pool import ColdPool, cold_page_bytes, layer_codec_name, split_layer_codec


def test_split_names_and_their_bytes() -> None:
    assert split_layer_codec("fp8_e4m3") == ("fp8_e4m3", "fp8_e4m3")
    assert split_layer_codec("int4/fp4_e2m1") == ("int4", "fp4_e2m1")
    assert layer_codec_name("int4", "int4") == "int4"
    assert layer_codec_name("fp8_e4m3", "fp4_e2m1") == "fp8_e4m3/fp4_e2m1"
    for bad in ("int4/", "/int4", "int4/int8/fp4_e2m1"):
        with pytest.raises(ValueError, match="KEY/VALUE"):
            split_layer_codec(bad)
    k = get_codec("int4").page_bytes(16, 2, 64, "channel")
    v = get_codec("fp4_e2m1").page_bytes(16, 2, 64, "token")
    # int4 keys: codes 1,024 + an int16 word per channel and the page-head unit (2 heads x 65 x 2 bytes)
    assert cold_page_bytes(["int4/fp4_e2m1"], 16, 2, 64) == k + v == 1284 + 1152
    assert cold_page_bytes(["fp4_e2m1", "int4/fp4_e2m1"], 16, 2, 64) == (
        cold_page_bytes(["fp4_e2m1"], 16, 2, 64) + k + v
    )


def test_pool_writes_keys_and_values_with_their_own_codec() -> None:
    torch.manual_seed(0)
    k = torch.randn(3, 16, 2, 64) + torch.linspace(0, 40, 64)  # an offset that grows along the channels
    v = torch.randn(3, 16, 2, 64)
    pool = ColdPool(["fp4_e2m1", "int4/fp4_e2m1"], 4, 16, 2, 64, "cpu")
    ids = torch.tensor([2, 0, 3])
    pool.write(1, ids, k, v)
    kq, vq = pool.read(1, ids, torch.float32)
    int4, fp4 = get_codec("int4"), get_codec("fp4_e2m1")
    assert torch.equal(kq, int4.dequantize(int4.quantize(k, granularity="channel")))
    assert torch.equal(vq, fp4.dequantize(fp4.quantize(v, granularity="token")))
    assert pool.total_bytes == 4 * pool.page_bytes
    # keys with a large per-channel offset: int4's affine grid keeps their variation, fp4's does not
    pool.write(0, ids, k, v)
    k4, _ = pool.read(0, ids, torch.float32)
    assert (k4 - k).norm() > 5 * (kq - k).norm()
