from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvstrata.quant import get_codec
from kvstrata.quant.scales import FORMAT_VERSION, ScalesFile, ScaleStats


def filled_stats(per_channel: bool = False) -> ScaleStats:
    """2 layers, 2 heads, head_dim 8: |x| of head h in layer l runs over 1..1000 times (l + 1) (h + 1)."""
    stats = ScaleStats(per_channel=per_channel)
    ramp = torch.arange(1, 1001, dtype=torch.float32)  # 1000 distinct magnitudes
    for layer in range(2):
        for kind, sign in (("k", 1.0), ("v", -1.0)):
            factor = torch.tensor([1.0, 2.0]).view(1, 2, 1) * (layer + 1)
            x = sign * ramp.view(125, 1, 8).expand(125, 2, 8) * factor  # [125 tokens, 2, 8]
            stats.observe(layer, kind, x[:60])
            stats.observe(layer, kind, x[60:])  # accumulation across calls
    return stats


def test_absmax_is_exact():
    stats = filled_stats()
    assert torch.equal(stats.absmax(0, "k"), torch.tensor([1000.0, 2000.0]))
    assert torch.equal(stats.absmax(1, "v"), torch.tensor([2000.0, 4000.0]))
    per_channel = filled_stats(per_channel=True)
    expected = torch.tensor([993.0, 994, 995, 996, 997, 998, 999, 1000])
    assert torch.equal(per_channel.absmax(0, "k"), torch.stack([expected, 2 * expected]))


@pytest.mark.parametrize("q", [50.0, 99.0, 99.9])
def test_percentile_bounds_the_true_one_within_a_bin(q: float):
    stats = filled_stats()
    estimate = stats.percentile(0, "k", q)
    true = torch.quantile(torch.arange(1, 1001, dtype=torch.float64), q / 100, interpolation="higher")
    for head, factor in enumerate((1.0, 2.0)):
        assert true * factor <= estimate[head] <= true * factor * 2 ** (1 / 16)


def test_values_beyond_the_histogram_range():
    stats = ScaleStats(min_exp=-4, max_exp=4)
    x = torch.tensor([0.0, 1e-3, 3.0, 1e5]).view(4, 1, 1)
    stats.observe(0, "v", x)
    assert stats.percentile(0, "v", 25.0).item() == 2**-4  # zeros and tiny values share the first bin
    assert stats.percentile(0, "v", 50.0).item() == 2**-4
    assert 3.0 <= stats.percentile(0, "v", 75.0).item() <= 3.0 * 2 ** (1 / 16)
    assert stats.percentile(0, "v", 100.0).item() == 1e5  # past the last bin edge: the absmax


def test_nonfinite_is_counted_and_ignored():
    stats = ScaleStats()
    x = torch.ones(4, 2, 8)
    x[0, 0, 0], x[1, 1, 1] = float("nan"), float("inf")
    stats.observe(0, "k", x)
    assert stats.nonfinite(0, "k") == 2
    assert torch.equal(stats.absmax(0, "k"), torch.ones(2))
    assert torch.equal(stats.percentile(0, "k", 100.0), torch.ones(2))


def test_scales_file_round_trip(tmp_path: Path):
    sf = filled_stats().to_scales_file("percentile", 90.0, {"name": "tiny", "sha256": "ab"})
    path = tmp_path / "scales.json"
    sf.save(path)
    loaded = ScalesFile.load(path)
    data = json.loads(path.read_text())
    assert data["format_version"] == FORMAT_VERSION and data["method"] == "percentile"
    assert data["model"] == {"name": "tiny", "sha256": "ab"} and data["created"] == sf.created
    assert (loaded.num_layers, loaded.kv_heads, loaded.head_dim, loaded.percentile) == (2, 2, 8, 90.0)
    for kind in ("k", "v"):
        assert torch.equal(loaded.absmax[kind], sf.absmax[kind])
        assert torch.equal(loaded.clips[kind], sf.clips[kind])
    clip = loaded.clip(1, "v")
    assert clip.shape == (2, 1)
    assert torch.equal(clip, sf.clips["v"][1].unsqueeze(-1))
    assert (clip[:, 0] < loaded.absmax["v"][1]).all()  # the 90th percentile is below the max


def test_max_method_and_per_channel_clip_feed_a_codec():
    sf = filled_stats(per_channel=True).to_scales_file("max", None, "tiny")
    clip = sf.clip(0, "k")
    assert clip.shape == (2, 8) and torch.equal(clip, sf.absmax["k"][0])
    x = torch.full((16, 2, 8), 994.0)
    q = get_codec("int8").quantize(x, "channel", static_absmax=clip)
    assert q.overflow == 16  # channel 0 of head 0 (clip 993) clips every token; nothing else clips
    q = get_codec("int8").quantize(x, "channel", static_absmax=sf.clip(1, "k"))
    assert q.overflow == 0


def test_geometry_mismatch_is_clear():
    sf = filled_stats().to_scales_file()
    sf.check_geometry(2, 2, 8)
    with pytest.raises(
        ValueError,
        match=r"file has \(num_layers, kv_heads, head_dim\) = \(2, 2, 8\), model has \(30, 3, 64\)",
    ):
        sf.check_geometry(30, 3, 64)


def test_bad_files_and_inputs(tmp_path: Path):
    sf = filled_stats().to_scales_file()
    data = sf.to_json()
    data["format_version"] = 99
    (tmp_path / "v99.json").write_text(json.dumps(data))
    with pytest.raises(ValueError, match="unsupported scales file format_version 99"):
        ScalesFile.load(tmp_path / "v99.json")
    (tmp_path / "junk.json").write_text("{")
    with pytest.raises(ValueError, match="cannot read scales file"):
        ScalesFile.load(tmp_path / "junk.json")
    data = sf.to_json()
    data["clip"]["k"] = [[1.0, 2.0]]
    with pytest.raises(ValueError, match=r"clips\['k'\] has shape \(1, 2\), expected \(2, 2\)"):
        ScalesFile.from_json(data)
    with pytest.raises(IndexError, match="layer 2 out of range"):
        sf.clip(2, "k")
    with pytest.raises(ValueError, match="kind must be one of"):
        sf.clip(0, "q")
    stats = ScaleStats()
    stats.observe(1, "k", torch.ones(2, 2, 8))
    with pytest.raises(ValueError, match="no statistics for layer/kind: 0k, 0v, 1v"):
        stats.to_scales_file()
    with pytest.raises(ValueError, match="geometry changed"):
        stats.observe(0, "k", torch.ones(2, 3, 8))
    with pytest.raises(ValueError, match="method must be one of"):
        filled_stats().to_scales_file("mse")
