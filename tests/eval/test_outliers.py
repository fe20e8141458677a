"""Planted outlier key channels: the model's function is unchanged, its keys are hard, and the shipped
defaults (per-channel key scales per page, BF16 recent window, sinks) keep 4-bit drift bounded."""

from __future__ import annotations

import torch

from kvstrata.eval.configs import SHIPPED_DEFAULTS, EvalConfig, build_grid
from kvstrata.eval.corpus import read_corpus, tokenize_windows
from kvstrata.eval.outliers import outlier_channels
from kvstrata.eval.runner import evaluate
from kvstrata.eval.stats import summarize


def _keys(model, ids: torch.Tensor, layer: int) -> torch.Tensor:
    captured: dict[int, torch.Tensor] = {}
    dense = model.net.dense_attn_for([ids.shape[0]])

    def attn(i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        captured[i] = k
        return dense(i, q, k, v)

    with torch.inference_mode():
        model.net(ids, torch.arange(ids.shape[0]), attn=attn)
    return captured[layer]


def test_planting_keeps_the_function_and_makes_per_token_key_scales_fail(tiny_models) -> None:
    from kvstrata.engine.loader import load_model
    from kvstrata.quant import get_codec

    planted, plain = (load_model(p) for p in tiny_models)
    ids = torch.tensor(tokenize_windows(read_corpus(None), planted.tokenizer, 128, 128)[0])
    with torch.inference_mode():
        a = planted.net.dense_forward(ids[None])
        b = plain.net.dense_forward(ids[None])
    assert (a - b).abs().max().item() < 1e-4 * b.abs().max().item()

    k = _keys(planted, ids, layer=0)  # [T, H, D]
    head_dim = k.shape[-1]
    chans = outlier_channels(head_dim, (3, 17))
    normal = [c for c in range(head_dim) if c not in chans]
    ratio = k[..., chans].abs().mean() / k[..., normal].abs().mean()
    assert ratio > 10  # the planted channels dominate the keys

    codec = get_codec("int4")
    pages = k[: (k.shape[0] // 16) * 16].reshape(-1, 16, *k.shape[1:])
    errors = {}
    for granularity in ("token", "channel"):
        y = codec.dequantize(codec.quantize(pages, granularity=granularity))
        err = (y - pages)[..., normal].pow(2).mean().sqrt() / pages[..., normal].pow(2).mean().sqrt()
        errors[granularity] = err.item()
    # per-token scales spend the 4-bit range on the outliers; per-channel (what the cache uses) do not
    assert errors["channel"] < 0.15
    assert errors["token"] > 5 * errors["channel"]


def test_shipped_defaults_bound_4bit_drift_on_planted_outliers(tiny_models) -> None:
    """Context 512 (> every shipped window) so that history really comes from 4-bit cold pages.

    The random model's perplexity is near the vocabulary size, so its drift sign is noise; KL and top-1
    carry the signal. Measured: int4 KL 2.5e-3, fp4 1.3e-3; window 0 4-19x worse; Hadamard rotation
    on top of per-channel key scales 30-80x worse (it smears the outlier channels over all channels),
    which is why rotation is off by default.
    """
    from kvstrata.engine.loader import load_model
    from kvstrata.quant import list_codecs

    model = load_model(tiny_models[0])
    windows = tokenize_windows(read_corpus(None), model.tokenizer, 512, 1024)
    shipped = build_grid(["int4", "fp4_e2m1"], None, None, None, list_codecs())[1:]
    bare = [EvalConfig(c.kv_cache_dtype, None, 0, False, False) for c in shipped]
    rotated = [EvalConfig(c.kv_cache_dtype, None, c.recent_window, True, c.sinks) for c in shipped]
    reference = EvalConfig("auto", None, 0, False, False)
    scores, _ = evaluate(model, windows, [reference, *shipped, *bare, *rotated], 16)
    result = {cfg: summarize(scores[cfg], resamples=500) for cfg in scores}
    for cfg in shipped:
        d = SHIPPED_DEFAULTS[cfg.kv_cache_dtype]
        assert (cfg.recent_window, cfg.rotation, cfg.sinks) == (d.recent_window, d.rotation, d.sinks)
        assert cfg.recent_window < 512
        s = result[cfg]
        assert abs(s.drift_pct) < 0.5, (cfg.label, s)
        assert s.kl < 4e-3, (cfg.label, s)
        assert s.top1_agreement > 0.88, (cfg.label, s)
    for ship, b, r in zip(shipped, bare, rotated, strict=True):
        assert result[b].kl > 3 * result[ship].kl  # the BF16 window and sinks matter
        assert result[r].kl > 10 * result[ship].kl  # rotation breaks per-channel key scales here
