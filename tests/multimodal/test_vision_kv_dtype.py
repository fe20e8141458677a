"""``--vision-kv-dtype``: image pages live in a pool of their own codec while text pages are quantized.

A prompt that starts with its image caches only image pages (the text after it stays in the float32
ring), so with float32 image pages our logits equal transformers' within 1e-4 although the text codec
is int4; with the image pages in int4 (the text pool's codec) they do not."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstrata import Engine
from kvstrata.engine.loader import load_model
from kvstrata.engine.options import EngineArgs, resolve_vision_codec

from .test_vlm_logits import TOL, LogitSpy, hf_ids, hf_logits, prompt, run
from .tiny_vlm import hf_vlm, make_image, save_vlm

QUANTIZED = {
    "kv_cache_dtype": "int4",
    "kv_plan": "off",
    "ring_dtype": "float32",
    "sinks": False,
    "rotation": False,
    "page_size": 4,
    "recent_window": 16,
    "max_total_tokens": 1024,
}


@pytest.fixture(scope="module")
def llava(tmp_path_factory: pytest.TempPathFactory):
    model = hf_vlm("llava", "siglip", seed=4)
    return model, save_vlm(model, Path(tmp_path_factory.mktemp("llava-kv")))


def cached_error(llava, vision_kv_dtype: str) -> tuple[float, Engine]:
    """Largest |logit - transformers| of a request whose 16 image tokens come from the cache."""
    model, path = llava
    loaded = load_model(path)
    n = loaded.vision.cfg.tokens_per_image
    ids = prompt(3, [0], seed=2)  # the image first: 16 image tokens (4 pages), then 3 text tokens
    image = make_image(5)
    pixels = [loaded.vision.preprocess(image)]
    engine = Engine(loaded, vision_kv_dtype=vision_kv_dtype, **QUANTIZED)
    spy = LogitSpy(engine)
    run(engine, spy, ids, [image], "first")
    first = (spy.rows["first"] - hf_logits(model, hf_ids(ids, "llava", n), pixels, "llava")).abs().max()
    assert float(first) < TOL  # one prefill step reads no cold page
    second = run(engine, spy, ids + [7, 8], [image], "second")
    assert second["meta_info"]["cached_tokens"] == n  # the 4 image pages, read back from their pool
    ref = hf_logits(model, hf_ids(ids + [7, 8], "llava", n), pixels, "llava")
    return float((spy.rows["second"] - ref).abs().max()), engine


def test_fp32_image_pages_next_to_int4_text_equal_transformers(llava):
    err, engine = cached_error(llava, "fp32")
    with engine:
        assert err < TOL
        stats = engine.check_invariants()
        image, cold = stats.tiers["image"], stats.tiers["cold"]
        assert (image.cached, image.pinned) == (4, 4)  # the image span's pages, pinned
        assert image.unit_bytes == engine.cache.image_pool.page_bytes
        assert engine.cache.image_pool.codec_names == ["fp32"] * engine.config.num_layers
        assert engine.layer_codecs() == ["int4"] * engine.config.num_layers
        assert cold.pinned == 0 and stats.pinned_bytes == 4 * image.unit_bytes
        plan = engine.core.memory_plan  # the image pool is a row of the memory plan
        assert plan.image_pages == image.total and plan.image_bytes == image.bytes("total") + image.unit_bytes


def test_image_pages_in_the_text_codec_lose_the_match(llava):
    err_int4, engine = cached_error(llava, "int4")  # same codec as the text: one pool
    with engine:
        assert engine.cache.image_pool is None and "image" not in engine.cache_stats().tiers
        assert err_int4 > 100 * TOL
    err_bf16, engine = cached_error(llava, "bf16")  # the default on a quantized pool
    with engine:
        assert engine.cache.image_pool.codec_names[0] == "bf16"
    assert err_bf16 < err_int4 / 10
    print(f"max |logit error| with cached image pages: int4 {err_int4:.2e}, bf16 {err_bf16:.2e}")


@pytest.mark.parametrize(
    ("value", "codecs", "expect"),
    [
        ("auto", ["fp32", "fp32"], None),  # an unquantized pool already holds images exactly
        ("auto", ["int4", "int4"], "bf16"),  # nothing measured: BF16, on both attention backends
        ("fp8_e4m3", ["int4", "fp8_e4m3"], "fp8_e4m3"),
        ("int4", ["int4", "int4"], None),  # the text codec: no second pool
    ],
)
def test_resolve_vision_codec(value: str, codecs: list[str], expect: str | None):
    assert resolve_vision_codec(EngineArgs(vision_kv_dtype=value), codecs) == expect


def test_unknown_vision_codec_is_refused():
    with pytest.raises(ValueError, match="int3"):
        EngineArgs(vision_kv_dtype="int3").validate()


def test_auto_uses_bf16_image_pages_for_a_quantized_pool(llava):
    _, path = llava
    with Engine(load_model(path), **QUANTIZED) as engine:
        assert engine.cache.image_pool is not None
        assert engine.cache.image_pool.codec_names[0] == "bf16"
        assert engine.cache_config.image_token_from == engine.config.vocab_size
    with Engine(load_model(path), **{**QUANTIZED, "kv_cache_dtype": "auto"}) as engine:
        assert engine.cache.image_pool is None
