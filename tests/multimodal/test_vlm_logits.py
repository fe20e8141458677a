"""Our vision-language forward over the stratified cache equals transformers' (float32, 1e-4):
uncached, with the image span cached, and in a batch of different images; LLaVA (CLIP and SigLIP
towers) and Idefics3."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from kvstrata import Engine
from kvstrata.engine.loader import load_model

from .tiny_vlm import IMAGE_TOKEN, hf_vlm, make_image, save_vlm

TOL = 1e-4
ENGINE = {"kv_cache_dtype": "auto", "page_size": 4, "recent_window": 8, "max_total_tokens": 2048}


class LogitSpy:
    """Records the logits each engine step computes (the last position of each finished prompt)."""

    def __init__(self, engine: Engine) -> None:
        self.rows: dict[str, torch.Tensor] = {}
        runner = engine.runner
        original = runner.run

        def run(plan: Any) -> Any:
            sampled, out, logits = original(plan)
            for i, req in enumerate(sampled):
                if not req.output_ids:
                    self.rows[req.rid] = logits[i].detach().clone()
            return sampled, out, logits

        runner.run = run


def hf_logits(
    model: torch.nn.Module, ids: list[int], pixels: list[torch.Tensor], family: str
) -> torch.Tensor:
    kwargs: dict[str, Any] = {}
    if pixels:
        px = torch.stack(pixels)[None] if family == "idefics3" else torch.stack(pixels)
        kwargs["pixel_values"] = px
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids]), **kwargs).logits[0, -1].float()


def hf_ids(ids: list[int], family: str, n: int) -> list[int]:
    """What transformers' processor makes of one image token: ``n`` image tokens (Idefics3 keeps its
    wrap tokens outside; the tiny test tokenizer has none)."""
    out: list[int] = []
    for t in ids:
        out.extend([t] * n if t == IMAGE_TOKEN else [t])
    return out


CASES = [("llava", "clip"), ("llava", "siglip"), ("idefics3", "siglip")]


@pytest.fixture(scope="module", params=CASES, ids=lambda c: "-".join(c))
def vlm(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    family, kind = request.param
    model = hf_vlm(family, kind)
    path = save_vlm(model, Path(tmp_path_factory.mktemp(f"{family}-{kind}")))
    loaded = load_model(path)
    engine = Engine(loaded, **ENGINE)
    spy = LogitSpy(engine)
    yield family, model, loaded, engine, spy
    engine.shutdown()


def prompt(n_text: int, image_at: list[int], seed: int = 0) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, IMAGE_TOKEN, (n_text,), generator=g).tolist()
    for pos in sorted(image_at, reverse=True):
        ids.insert(pos, IMAGE_TOKEN)
    return ids


def run(engine: Engine, spy: LogitSpy, ids: list[int] | list[list[int]], images: Any, rid: Any) -> Any:
    return engine.generate(
        input_ids=ids, image_data=images, rid=rid, sampling_params={"max_new_tokens": 1, "temperature": 0}
    )


def test_uncached_then_cached_span_equal_transformers(vlm):
    family, model, loaded, engine, spy = vlm
    vision = loaded.vision
    n = vision.cfg.tokens_per_image
    ids = prompt(21, [5])
    image = make_image(1)
    ref = hf_logits(model, hf_ids(ids, family, n), [vision.preprocess(image)], family)
    before = engine.vision_stats()
    first = run(engine, spy, ids, [image], "u1")
    torch.testing.assert_close(spy.rows["u1"], ref, atol=TOL, rtol=0)
    second = run(engine, spy, ids + [7, 8], [image], "u2")
    ref2 = hf_logits(model, hf_ids(ids + [7, 8], family, n), [vision.preprocess(image)], family)
    torch.testing.assert_close(spy.rows["u2"], ref2, atol=TOL, rtol=0)
    after = engine.vision_stats()
    assert after["encoded_images"] - before["encoded_images"] == 1  # the second request skipped the tower
    assert after["cached_images"] - before["cached_images"] == 1
    assert first["meta_info"]["cached_tokens"] == 0
    # the image span (page aligned) is cached: every placeholder row but the unshared last page
    span_end = 5 + n + (2 if vision.wrap else 0)
    assert second["meta_info"]["cached_tokens"] >= span_end // 4 * 4
    engine.check_invariants()


def test_batch_of_different_images_and_two_images_in_one_prompt(vlm):
    family, model, loaded, engine, spy = vlm
    vision = loaded.vision
    n = vision.cfg.tokens_per_image
    a, b, c = make_image(11), make_image(12, (20, 50)), make_image(13)
    one = prompt(14, [3], seed=5)
    two = prompt(17, [2, 9], seed=6)
    run(engine, spy, [one, one, two], [[a], [b], [b, c]], ["b0", "b1", "b2"])
    for rid, ids, imgs in (("b0", one, [a]), ("b1", one, [b]), ("b2", two, [b, c])):
        ref = hf_logits(model, hf_ids(ids, family, n), [vision.preprocess(i) for i in imgs], family)
        torch.testing.assert_close(spy.rows[rid], ref, atol=TOL, rtol=0)
    # different images under the same text never share their spans
    assert not torch.allclose(spy.rows["b0"], spy.rows["b1"], atol=TOL)
    engine.check_invariants()


def test_idefics3_wrap_tokens_around_each_image(tmp_path: Path):
    model = hf_vlm("idefics3", "siglip", seed=3)
    loaded = load_model(save_vlm(model, tmp_path))
    vision = loaded.vision
    n = vision.cfg.tokens_per_image
    fake, glob = (
        5,
        6,
    )  # stand-ins for <fake_token_around_image>, <global-img> (the tiny model has no tokenizer)
    vision.wrap = (fake, glob)
    ids = prompt(15, [4], seed=9)
    image = make_image(31)
    with Engine(loaded, **ENGINE) as engine:
        spy = LogitSpy(engine)
        out = run(engine, spy, ids, [image], "w0")
    hf = []
    for t in ids:
        hf.extend([fake, glob, *[IMAGE_TOKEN] * n, fake] if t == IMAGE_TOKEN else [t])
    assert out["meta_info"]["prompt_tokens"] == len(hf)
    ref = hf_logits(model, hf, [vision.preprocess(image)], "idefics3")
    torch.testing.assert_close(spy.rows["w0"], ref, atol=TOL, rtol=0)
