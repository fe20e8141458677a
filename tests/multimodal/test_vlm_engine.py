"""Engine-level image caching: pins under eviction pressure, unpin, budget refusal, bad images."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstrata import Engine
from kvstrata.engine.loader import load_model
from kvstrata.multimodal.images import ImageError
from kvstrata.radix.errors import PinBudgetExceeded

from .tiny_vlm import IMAGE_TOKEN, data_url, hf_vlm, make_image, png_bytes, save_vlm

GREEDY = {"max_new_tokens": 2, "temperature": 0}
SPAN = 16  # image tokens of the tiny LLaVA


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory):
    return load_model(save_vlm(hf_vlm("llava", "clip"), Path(tmp_path_factory.mktemp("llava"))))


def image_prompt(seed: int = 0) -> list[int]:
    ids = torch.randint(3, IMAGE_TOKEN, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
    return ids[:4] + [IMAGE_TOKEN] + ids[4:]


def text_prompt(i: int, n: int = 120) -> list[int]:
    return torch.randint(3, IMAGE_TOKEN, (n,), generator=torch.Generator().manual_seed(1000 + i)).tolist()


def test_pinned_image_survives_text_pressure_and_unpin_releases_it(loaded):
    with Engine(loaded, kv_cache_dtype="auto", page_size=4, recent_window=8, max_total_tokens=256) as eng:
        image = data_url(make_image(7))
        base = eng.vision_stats()  # the counters belong to the model, shared by this module's engines
        first = eng.generate(input_ids=image_prompt(), image_data=[image], sampling_params=GREEDY)
        pins = eng.list_pins()
        assert [(p["kind"], p["tokens"]) for p in pins] == [("image", (4 + SPAN) // 4 * 4)]
        for i in range(8):  # 8 x 122 tokens through a 256-token pool: the tree is evicted again and again
            eng.generate(input_ids=text_prompt(i), sampling_params=GREEDY)
            stats = eng.check_invariants()
            assert stats.pinned_pages == 5
        assert stats.evicted_pages > 0
        again = eng.generate(input_ids=image_prompt(), image_data=[image], sampling_params=GREEDY)
        assert again["meta_info"]["cached_tokens"] >= 20
        assert again["output_ids"] == first["output_ids"]
        now = eng.vision_stats()
        assert now["encoded_images"] - base["encoded_images"] == 1
        assert now["cached_images"] - base["cached_images"] == 1
        eng.unpin(pins[0]["id"])
        assert eng.check_invariants().pinned_pages == 0
        for i in range(8, 12):
            eng.generate(input_ids=text_prompt(i), sampling_params=GREEDY)
        third = eng.generate(input_ids=image_prompt(), image_data=[image], sampling_params=GREEDY)
        assert third["meta_info"]["cached_tokens"] == 0  # evicted once unpinned
        assert third["output_ids"] == first["output_ids"]
        assert eng.vision_stats()["encoded_images"] - base["encoded_images"] == 2
        assert [p["id"] for p in eng.list_pins()] == [pins[0]["id"]]  # the same prefix pinned again
        eng.unpin(pins[0]["id"])
        with pytest.raises(KeyError):
            eng.unpin(pins[0]["id"])
        eng.check_invariants()


def test_n_samples_with_an_image_encode_it_once(loaded):
    with Engine(loaded, kv_cache_dtype="auto", page_size=4, recent_window=8, max_total_tokens=512) as eng:
        image = make_image(9)
        params = {"n": 3, "max_new_tokens": 3, "temperature": 0}
        before = eng.vision_stats()  # the counters belong to the model, shared by this module's engines
        outs = eng.generate(input_ids=image_prompt(2), image_data=[image], sampling_params=params)
        assert len(outs) == 3 and all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
        after = eng.vision_stats()
        assert after["encoded_images"] - before["encoded_images"] == 1
        assert after["cached_images"] - before["cached_images"] == 2  # the siblings match the span
        single = eng.generate(input_ids=image_prompt(2), image_data=[image], sampling_params=GREEDY)
        assert single["output_ids"] == outs[0]["output_ids"][:2]
        eng.check_invariants()


def test_pin_budget_refuses_clearly_and_requests_still_run(loaded):
    kw = dict(kv_cache_dtype="auto", page_size=4, recent_window=8, max_total_tokens=512, max_pinned_tokens=24)
    with Engine(loaded, **kw) as eng:
        eng.generate(input_ids=image_prompt(0), image_data=[make_image(1)], sampling_params=GREEDY)  # 5 pages
        out = eng.generate(input_ids=image_prompt(1), image_data=[make_image(2)], sampling_params=GREEDY)
        assert out["meta_info"]["finish_reason"]["type"] == "length"
        stats = eng.check_invariants()
        assert (stats.pins_created, stats.pins_refused, stats.pinned_pages) == (1, 1, 5)
        assert stats.pin_budget_bytes == 6 * eng.cache.pool.page_bytes
        with pytest.raises(PinBudgetExceeded, match="over the pin budget"):
            eng.pin(input_ids=text_prompt(0, 40))
        text_pin = eng.pin(input_ids=text_prompt(1, 5))  # one page fits
        assert (text_pin["kind"], text_pin["tokens"], text_pin["pages"]) == ("prefix", 4, 1)
        assert eng.check_invariants().pins_refused == 2


@pytest.mark.parametrize(
    ("image", "message"),
    [
        (b"this is not an image", "not a readable image"),
        (png_bytes(make_image(3))[:50], "not a readable image"),
        ("https://example.com/cat.png", "fetching remote images is off"),
    ],
)
def test_bad_images_are_refused_before_the_cache_sees_them(loaded, image, message):
    kw = dict(kv_cache_dtype="auto", page_size=4, recent_window=8, max_total_tokens=256, pin_ttl=None)
    with Engine(loaded, **kw) as eng:
        eng.generate(input_ids=image_prompt(), image_data=[make_image(4)], sampling_params=GREEDY)
        before = eng.check_invariants()
        with pytest.raises(ImageError, match=message):
            eng.generate(input_ids=image_prompt(), image_data=[image], sampling_params=GREEDY)
        with pytest.raises(ValueError, match="1 image tokens .* for 2 images"):
            eng.generate(input_ids=image_prompt(), image_data=[make_image(4)] * 2, sampling_params=GREEDY)
        assert eng.check_invariants() == before


def test_too_many_pixels_is_refused(loaded):
    kw = dict(kv_cache_dtype="auto", page_size=4, max_total_tokens=256, max_image_pixels=1000)
    too_big = make_image(5, (40, 30))
    with Engine(loaded, **kw) as eng, pytest.raises(ImageError, match="more than the limit of 1000"):
        eng.generate(input_ids=image_prompt(), image_data=[too_big], sampling_params=GREEDY)


def test_sparse_published_config_gets_transformers_defaults(tmp_path: Path):
    """A config.json that omits every field equal to transformers' default (as published LLaVA
    checkpoints do; here the tower's image_size 224 and patch_size 32 among them) loads to the same
    model as the complete one."""
    import json

    import transformers

    full_dir = save_vlm(hf_vlm("llava", "clip", image_size=224, patch_size=32), tmp_path / "full")
    full = load_model(full_dir)
    cfg = json.loads((full_dir / "config.json").read_text())
    defaults = {
        "text_config": transformers.LlamaConfig().to_dict(),
        "vision_config": transformers.CLIPVisionConfig().to_dict(),
    }
    for name, default in defaults.items():
        sub = cfg[name]
        for key in [k for k in sub if k != "model_type" and k in default and default[k] == sub[k]]:
            del sub[key]
    assert "image_size" not in cfg["vision_config"] and "patch_size" not in cfg["vision_config"]
    (full_dir / "config.json").write_text(json.dumps(cfg))
    sparse = load_model(full_dir)
    assert sparse.config == full.config and sparse.vision.cfg == full.vision.cfg
    assert sparse.vision.cfg.tokens_per_image == 49


def test_image_pin_expires_after_its_ttl(loaded):
    kw = dict(kv_cache_dtype="auto", page_size=4, recent_window=8, max_total_tokens=256, pin_ttl=30.0)
    with Engine(loaded, **kw) as eng:
        now = [1000.0]
        eng.cache.pins.clock = lambda: now[0]  # a fake clock the engine thread reads
        eng.generate(input_ids=image_prompt(), image_data=[make_image(8)], sampling_params=GREEDY)
        (pin,) = eng.list_pins()
        assert pin["ttl_s"] == 30.0
        now[0] += 29.0
        assert [p["id"] for p in eng.list_pins()] == [pin["id"]]
        now[0] += 1.5
        assert eng.list_pins() == []
        stats = eng.check_invariants()
        assert (stats.pins_created, stats.pins_expired, stats.pinned_pages) == (1, 1, 0)
