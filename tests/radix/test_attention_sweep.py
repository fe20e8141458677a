"""`benchmarks/attention_sweep.py` on CPU: a 4-bit variant reaches the launch as written."""

import importlib
from pathlib import Path

import pytest

from kvstrata.radix.kernels import attend

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"


@pytest.fixture
def sweep(monkeypatch):
    """The sweep module, with every launch table and rule its ``apply`` replaces restored afterwards."""
    monkeypatch.syspath_prepend(str(Path(__file__).parents[2] / "benchmarks"))
    monkeypatch.delenv("SWEEP_4BIT", raising=False)
    rules = (
        "INT4_DECODE",
        "INT4_TURNED_TAIL",
        "INT4_TURNED_MAXNREG",
        "FP4_UNCAPPED_MAX_PAGES",
        "FP8_WIDE_DECODE",
    )
    for name in rules:
        monkeypatch.setattr(attend, name, getattr(attend, name))
    monkeypatch.setitem(attend.DECODE_LAUNCH, True, dict(attend.DECODE_LAUNCH[True]))
    return importlib.import_module("attention_sweep")


@pytest.mark.parametrize("rows", [128, 512, 4096])
@pytest.mark.parametrize("device_name", ["", H200, H100])
def test_4bit_variants_run_as_written(sweep, rows, device_name):
    """Every 4-bit variant, applied as the sweep applies it, is the launch an int4 layer at head_dim 128
    runs: over the shipped entry, not the variant before it (``magic_codes`` leaked into the variants
    after 27 in the twenty-first session's H100 sweep), and no key of int4's default shape, turned tail
    or per-card register cap (the first such sweep failed every case from 512 rows: KeyError
    ``maxnreg``)."""
    fmt = attend.INT4_FORMAT
    for variant in [*sweep.DECODE_4BIT, *sweep.DECODE_4BIT]:  # as the sweep's next case starts over
        sweep.apply(("decode", True), variant)
        got = attend.decode4_launch(attend.DECODE_LAUNCH[True], fmt, fmt, 128, 16, rows, device_name)
        assert attend.DECODE_LAUNCH[True] == {**sweep.SHIPPED["decode", True], **variant}
        for key, value in variant.items():
            assert got[key] == value, (variant, key)
        assert got.get("maxnreg") == variant.get("maxnreg", attend.DECODE_LAUNCH[True].get("maxnreg"))
        fp4 = attend.FP4_FORMAT  # nor fp4's uncapped short tables
        got = attend.decode4_launch(attend.DECODE_LAUNCH[True], fp4, fp4, 128, 16, rows, device_name, 64)
        assert got == attend.DECODE_LAUNCH[True]


def test_shipped_int4_launch_keeps_the_card_cap():
    """Off the sweep, int4 from 512 rows at head_dim 128 takes the turned tail and the card's cap."""
    fmt = attend.INT4_FORMAT
    base, default = attend.DECODE_LAUNCH[True], attend.INT4_DECODE["maxnreg"]
    assert attend.decode4_launch(base, fmt, fmt, 128, 16, 512, H200)["maxnreg"] == 128
    assert attend.decode4_launch(base, fmt, fmt, 128, 16, 512, "")["maxnreg"] == default
    assert attend.decode4_launch(base, fmt, fmt, 128, 16, 511, H200)["maxnreg"] == default
    turned = attend.decode4_launch(base, fmt, fmt, 128, 16, 512, "")
    assert all(turned[k] == v for k, v in attend.INT4_TURNED_TAIL.items())


@pytest.mark.parametrize("pages", [1, 128, 256, 257, 2048])
@pytest.mark.parametrize("device_name", ["", H200, H100])
def test_shipped_fp4_launch_uncapped_on_short_tables(pages, device_name):
    """Off the sweep, fp4 at head_dim 128 in 16-token pages runs uncapped on a card named in
    `FP4_UNCAPPED_MAX_PAGES` where the page table is at most that wide; everything else about the launch
    is the shipped entry's, and other cards, wider tables, other head or page sizes and int4 or mixed
    layers keep their caps."""
    fp4, int4 = attend.FP4_FORMAT, attend.INT4_FORMAT
    base = attend.DECODE_LAUNCH[True]
    got = attend.decode4_launch(base, fp4, fp4, 128, 16, 2048, device_name, pages)
    widest = attend.FP4_UNCAPPED_MAX_PAGES.get(device_name)
    uncapped = widest is not None and pages <= widest
    assert uncapped == (device_name == H100 and pages <= 256)
    assert got == ({**base, "maxnreg": None} if uncapped else base)
    assert attend.decode4_launch(base, fp4, fp4, 128, 16, 2048, device_name)["maxnreg"] == base["maxnreg"]
    assert (
        attend.decode4_launch(base, fp4, fp4, 64, 16, 2048, device_name, pages)["maxnreg"] == base["maxnreg"]
    )
    in_32_token_pages = attend.decode4_launch(base, fp4, fp4, 128, 32, 2048, device_name, pages)
    assert in_32_token_pages["maxnreg"] == base["maxnreg"]
    for k_fmt, v_fmt in ((int4, int4), (int4, fp4), (fp4, int4)):
        assert attend.decode4_launch(base, k_fmt, v_fmt, 128, 16, 256, device_name, pages)["maxnreg"] == 168
