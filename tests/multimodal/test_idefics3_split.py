"""Idefics3 / SmolVLM image splitting: tiles and the global image equal transformers' Idefics3 image
processor (PIL backend), the prompt layout is the processor's (``<fake><row_r_col_c>`` + placeholders per
tile, newlines, ``<fake><global-img>`` + placeholders + ``<fake>``), and the logits equal transformers'
Idefics3 model within 1e-4, uncached and with the split image cached."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from kvstrata import Engine
from kvstrata.engine.loader import load_model
from kvstrata.multimodal.inputs import SplitTokens
from kvstrata.multimodal.preprocess import Preprocessor

from .test_vlm_logits import ENGINE, TOL, LogitSpy, prompt, run
from .tiny_vlm import IMAGE_TOKEN, hf_vlm, make_image, save_vlm

PREPROCESSOR = {
    "do_image_splitting": True,
    "max_image_size": {"longest_edge": 28},  # the tiny tower's square
    "size": {"longest_edge": 56},  # at most 2 x 2 tiles
    "resample": 1,
    "image_mean": [0.5, 0.5, 0.5],
    "image_std": [0.5, 0.5, 0.5],
}
FAKE, GLOBAL, NEWLINE, TWO_NEWLINES = 5, 6, 7, 8  # stand-ins: the tiny model has no tokenizer
ROW_COL = ((10, 11), (12, 13))  # <row_1_col_1> ... <row_2_col_2>
SIZES = [(50, 37), (20, 64), (90, 20), (90, 90)]  # (width, height): 2 x 2, 2 x 1, 1 x 2, 2 x 2 tiles


def hf_processor(**overrides: object):
    from transformers.models.idefics3.image_processing_pil_idefics3 import Idefics3ImageProcessorPil

    return Idefics3ImageProcessorPil(**{**PREPROCESSOR, **overrides})


@pytest.mark.parametrize(
    ("size", "longest_edge"), [*((s, 56) for s in SIZES), ((50, 37), 28)], ids=lambda v: str(v)
)
def test_tiles_equal_transformers(size: tuple[int, int], longest_edge: int):
    hf = hf_processor(size={"longest_edge": longest_edge})  # 28: one tile, the global image alone
    ours = Preprocessor.from_hf(hf.to_dict(), 28)
    image = make_image(sum(size), size)
    ref = hf(image, return_tensors="np", return_row_col_info=True)
    tiles = ours.tiles(image)
    assert (tiles.rows, tiles.cols) == (ref["rows"][0][0], ref["cols"][0][0])
    got = torch.stack(tiles.pixels)
    torch.testing.assert_close(
        got, torch.as_tensor(np.asarray(ref["pixel_values"][0])).float(), atol=1e-5, rtol=0
    )


def processor_ids(ids: list[int], layouts: list[tuple[int, int]], n: int) -> list[int]:
    """What transformers' Idefics3Processor writes for each image token (its replace_image_token)."""
    out: list[int] = []
    images = iter(layouts)
    for t in ids:
        if t != IMAGE_TOKEN:
            out.append(t)
            continue
        rows, cols = next(images)
        for r in range(rows):
            for c in range(cols):
                out.extend([FAKE, ROW_COL[r][c], *[IMAGE_TOKEN] * n])
            out.append(NEWLINE if r < rows - 1 else TWO_NEWLINES)
        out.extend([FAKE, GLOBAL, *[IMAGE_TOKEN] * n, FAKE])
    return out


@pytest.fixture(scope="module")
def split_vlm(tmp_path_factory: pytest.TempPathFactory):
    model = hf_vlm("idefics3", "siglip", seed=7)
    loaded = load_model(save_vlm(model, Path(tmp_path_factory.mktemp("idefics3-split")), PREPROCESSOR))
    vision = loaded.vision
    assert vision.preprocess.split and vision.max_image_tokens == 5 * vision.cfg.tokens_per_image
    vision.wrap = (FAKE, GLOBAL)
    vision.split_tokens = SplitTokens(ROW_COL, (NEWLINE,), (TWO_NEWLINES,))
    engine = Engine(loaded, **ENGINE)
    yield model, loaded, engine, LogitSpy(engine)
    engine.shutdown()


def test_split_images_equal_transformers_uncached_and_cached(split_vlm):
    model, loaded, engine, spy = split_vlm
    n = loaded.vision.cfg.tokens_per_image
    hf = hf_processor()
    big, tall = make_image(41, SIZES[0]), make_image(42, SIZES[1])
    ids = prompt(9, [2, 6], seed=3)  # two images in one prompt: 2 x 2 tiles and 2 x 1 tiles

    def reference(token_ids: list[int]) -> tuple[list[int], torch.Tensor]:
        ref = hf([[big, tall]], return_tensors="pt", return_row_col_info=True)
        layouts = list(zip(ref["rows"][0], ref["cols"][0], strict=True))
        full = processor_ids(token_ids, layouts, n)
        with torch.no_grad():
            logits = model(
                input_ids=torch.tensor([full]),
                pixel_values=ref["pixel_values"],
                pixel_attention_mask=ref["pixel_attention_mask"],
            ).logits[0, -1]
        return full, logits

    full, ref = reference(ids)
    # text, then per image: (tiles + global) x (2 + n), a newline token per row, a closing <fake>
    assert len(full) == 9 + (4 + 1) * (n + 2) + 2 + 1 + (2 + 1) * (n + 2) + 2 + 1
    first = run(engine, spy, ids, [big, tall], "s1")
    assert first["meta_info"]["prompt_tokens"] == len(full)
    torch.testing.assert_close(spy.rows["s1"], ref, atol=TOL, rtol=0)
    before = engine.vision_stats()
    second = run(engine, spy, ids + [7, 8], [big, tall], "s2")
    _, ref2 = reference(ids + [7, 8])
    torch.testing.assert_close(spy.rows["s2"], ref2, atol=TOL, rtol=0)
    after = engine.vision_stats()
    assert after["encoded_images"] == before["encoded_images"]  # every tile came from the cache
    assert second["meta_info"]["cached_tokens"] >= (len(full) - 4) // 4 * 4
    stats = engine.check_invariants()
    assert stats.pins_created == 2  # one pin per image (ending at its global image), not per tile
