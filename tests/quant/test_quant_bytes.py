"""Byte accounting: declared sizes equal the bytes of the tensors actually stored."""

from __future__ import annotations

import pytest
import torch
from quant_helpers import as_pages, gaussian_kv

from kvstrata.quant import get_codec, list_codecs

H, D = 8, 128
# Exact bytes per token at 8 heads x 128: codes + scales (float32 per token-head unless noted).
EXPECTED_BYTES_PER_TOKEN = {
    "fp32": 4 * H * D,
    "bf16": 2 * H * D,
    "fp8_e4m3": H * D + H,  # one E8M0 scale byte per token-head
    "fp8_e5m2": H * D + H,
    "int8": H * D + 4 * H,
    "int8_asym": H * D + 8 * H,  # scale + offset
    "int4": H * D // 2 + 2 * H,  # one int16 scale word (scale + zero point) per token-head
    "fp4_e2m1": H * D // 2 + H * D // 32 + 2 * H,  # e4m3 per 32 elements + bf16 per token-head
}


def test_expected_table_covers_every_codec():
    assert set(EXPECTED_BYTES_PER_TOKEN) == set(list_codecs())


@pytest.mark.parametrize("name", list_codecs())
def test_bytes_per_token_is_exact(name: str):
    codec = get_codec(name)
    x = gaussian_kv(tokens=32, heads=H, head_dim=D)
    q = codec.quantize(x)
    assert codec.bytes_per_token(H, D) == EXPECTED_BYTES_PER_TOKEN[name]
    assert q.nbytes() == 32 * codec.bytes_per_token(H, D)


def test_bytes_per_token_budgets():
    per_elem = {n: get_codec(n).bytes_per_token(H, D) / (H * D) for n in list_codecs()}
    assert per_elem["bf16"] == 2.0
    for name in ("fp8_e4m3", "fp8_e5m2", "int8", "int8_asym"):
        assert per_elem[name] <= 1.0625, name
    assert per_elem["fp8_e4m3"] == 1.0078125 and per_elem["int8"] == 1.03125
    for name in ("int4", "fp4_e2m1"):
        assert per_elem[name] <= 0.6, name
    assert per_elem["int4"] == 0.515625 and per_elem["fp4_e2m1"] == 0.546875


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("name", list_codecs())
def test_page_parts_match_stored_parts(name: str, granularity: str):
    codec = get_codec(name)
    pages = as_pages(gaussian_kv(tokens=48, heads=2, head_dim=64))  # [3, 16, 2, 64]
    q = codec.quantize(pages, granularity)
    spec = codec.page_parts(16, 2, 64, granularity)
    assert set(spec) == set(q.parts)
    for part, (shape, dtype) in spec.items():
        assert q.parts[part].shape == (3, *shape) and q.parts[part].dtype == dtype, part
    assert codec.page_bytes(16, 2, 64, granularity) * 3 == q.nbytes()


@pytest.mark.parametrize("granularity", ["token", "channel"])
@pytest.mark.parametrize("name", list_codecs())
def test_pool_store_gather_decode(name: str, granularity: str):
    """A pool built from page_parts, filled page by page, decodes gathered pages exactly."""
    codec = get_codec(name)
    pages = as_pages(gaussian_kv(tokens=64, heads=2, head_dim=64))  # 4 pages
    spec = codec.page_parts(16, 2, 64, granularity)
    buf = {part: torch.zeros((6, *shape), dtype=dtype) for part, (shape, dtype) in spec.items()}
    slots = [5, 0, 3, 2]
    for page, slot in zip(pages, slots, strict=True):
        q = codec.quantize(page, granularity)
        for part in spec:
            buf[part][slot] = q.parts[part]
    ids = torch.tensor([3, 5])  # pages 2 and 0
    gathered = {part: buf[part][ids] for part in spec}
    y = codec.dequantize_parts(gathered, granularity, 64, torch.float32)
    direct = codec.dequantize(codec.quantize(pages, granularity))
    assert torch.equal(y, direct[[2, 0]])


def test_channel_page_bytes_at_page_16():
    """Channel scales are per page: their cost per token shrinks with the page size."""
    bytes_ = {n: get_codec(n).page_bytes(16, H, D, "channel") for n in list_codecs()}
    assert bytes_["fp8_e4m3"] == 16 * H * D + H  # one E8M0 byte per page and head
    assert bytes_["int8"] == 16 * H * D + 4 * H * D
    assert bytes_["int4"] == 16 * H * D // 2 + 2 * H * (D + 1)  # an int16 word per channel + the unit
    assert bytes_["fp4_e2m1"] == 16 * H * D // 2 + H * D + 2 * H  # e4m3 per 16 tokens + bf16 per head


def test_int4_page_head_fits_three_and_a_half_times_bf16():
    """Issue 11: int4 history holds >= 3.5x the tokens of BF16 history. A 16-token page of one head,
    K and V, head_dim 128: codes 2,048 bytes + 256 + 2 (keys: a word per channel, a BF16 unit) + 32
    (values: a word per token) = 2,338 bytes against 8,192 in BF16."""
    codec, bf16 = get_codec("int4"), get_codec("bf16")
    page = sum(codec.page_bytes(16, 1, D, g) for g in ("channel", "token"))
    assert page == 2338
    assert sum(bf16.page_bytes(16, 1, D, g) for g in ("channel", "token")) / page >= 3.5
