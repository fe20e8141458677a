"""`kvstrata calibrate` on a tiny GGUF model: clip values against transformers' own post-RoPE K/V cache."""

from __future__ import annotations

import json

import pytest
import tiny_models
import torch

from kvstrata.cli import main
from kvstrata.engine.calibrate import load_scales_for
from kvstrata.engine.loader import load_model

CORPUS = (
    "The theory of relativity usually encompasses two interrelated physics theories by Albert Einstein. "
    "Special relativity applies to all physical phenomena in the absence of gravity. "
    "General relativity explains the law of gravitation and its relation to the forces of nature. "
) * 3


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    import transformers

    tmp = tmp_path_factory.mktemp("calib")
    cfg = transformers.LlamaConfig(**tiny_models.TINY, tie_word_embeddings=False, rope_theta=10000.0)
    hf = transformers.LlamaForCausalLM(cfg).eval()
    tiny_models.randomize_(hf, seed=5)
    tiny_models.write_llama_gguf(hf, tmp / "tiny.gguf")
    (tmp / "corpus.txt").write_text(CORPUS)
    return tmp, hf


def calibrate(tmp, *extra: str) -> int:
    argv = ["calibrate", "--model", str(tmp / "tiny.gguf"), "--corpus", str(tmp / "corpus.txt")]
    return main([*argv, "--tokens", "300", "--context", "64", "--batch", "2", *extra])


def hf_kv_absmax(hf, ids: list[int], context: int) -> dict[str, torch.Tensor]:
    """Per layer and kv head absmax of K (post-RoPE, as transformers caches it) and V, window by window."""
    amax = {"k": torch.zeros(2, 2), "v": torch.zeros(2, 2)}
    for start in range(0, len(ids), context):
        window = torch.tensor(ids[start : start + context])[None]
        with torch.no_grad():
            cache = hf(window, use_cache=True).past_key_values
        for layer in range(2):
            for kind, t in (("k", cache.layers[layer].keys), ("v", cache.layers[layer].values)):
                amax[kind][layer] = torch.maximum(amax[kind][layer], t[0].abs().amax(dim=(1, 2)))
    return amax


def test_calibrate_max_matches_transformers_kv(setup, monkeypatch):
    tmp, hf = setup
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp / "cache"))
    out = tmp / "max.json"
    assert calibrate(tmp, "--method", "max", "--out", str(out)) == 0
    data = json.loads(out.read_text())
    assert data["format"] == "kvstrata-scales" and data["method"] == "max"
    assert data["geometry"] == {"num_layers": 2, "kv_heads": 2, "head_dim": 16}
    assert data["model"]["name"] == "tiny"
    tok = load_model(tmp / "tiny.gguf").tokenizer
    ids = tok(CORPUS)["input_ids"][:300]
    assert len(ids) == 300
    ref = hf_kv_absmax(hf, ids, 64)
    for kind in ("k", "v"):
        clip = torch.tensor(data["clip"][kind])
        assert clip.shape == (2, 2)
        assert torch.allclose(clip, ref[kind], rtol=1e-5), (kind, clip, ref[kind])


def test_calibrate_percentile_and_per_channel(setup, monkeypatch):
    tmp, _ = setup
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp / "cache"))
    out = tmp / "p.json"
    assert (
        calibrate(tmp, "--method", "percentile", "--percentile", "90", "--per-channel", "--out", str(out))
        == 0
    )
    scales = load_scales_for(out, load_model(tmp / "tiny.gguf").config)
    assert scales.per_channel and scales.percentile == 90
    for kind in ("k", "v"):
        clip, absmax = scales.clips[kind], scales.absmax[kind]
        assert clip.shape == (2, 2, 16)
        assert (clip <= absmax).all() and (clip > 0).all()
        assert (clip < absmax).float().mean() > 0.5  # the 90th percentile clips most channels
    assert scales.clip(1, "k").shape == (2, 16)


def test_scales_of_another_geometry_are_refused(setup, monkeypatch, tmp_path):
    tmp, _ = setup
    monkeypatch.setenv("KVSTRATA_CACHE_DIR", str(tmp / "cache"))
    out = tmp / "max2.json"
    assert calibrate(tmp, "--method", "max", "--out", str(out)) == 0
    other = load_model(tiny_models.save_hf(tiny_models.hf_model("qwen3"), tmp_path / "q3")).config
    with pytest.raises(ValueError, match=r"file has .* = \(2, 2, 16\), model has \(2, 2, 32\)"):
        load_scales_for(out, other)


def test_calibrate_argument_errors(setup, capsys):
    tmp, _ = setup
    assert calibrate(tmp, "--context", "0") == 2
    assert "--context must be positive" in capsys.readouterr().err
    argv = ["calibrate", "--model", str(tmp / "missing.gguf"), "--corpus", str(tmp / "corpus.txt")]
    assert main(argv) == 1
    assert "does not exist" in capsys.readouterr().err
