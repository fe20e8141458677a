"""The server's prompt-length pre-check counts an image's real prompt tokens: with Idefics3 image splitting
one image is several spans (tiles + the global image) plus their tile and wrap tokens, counted from the
image's size by the preprocessor's own arithmetic (no tower run). A prompt one token too long for the
served context is a 400 ``context_length_exceeded``; one that fits is served, and its default
``max_tokens`` fills the context exactly.

The tiny random Idefics3 gets a word-level tokenizer with SmolVLM's tile tokens, so the loader finds
them itself, as it does for a real SmolVLM checkpoint."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from kvstrata import Engine
from kvstrata.engine.loader import load_model
from kvstrata.server.app import create_app
from kvstrata.server.config import ServerConfig

from .test_idefics3_split import PREPROCESSOR, SIZES
from .test_vlm_logits import ENGINE
from .tiny_vlm import IMAGE_TOKEN, data_url, hf_vlm, make_image, save_vlm

SPECIAL = [
    "<fake_token_around_image>",
    "<global-img>",
    *(f"<row_{r}_col_{c}>" for r in (1, 2) for c in (1, 2)),
]


def save_tokenizer(out: Path) -> None:
    """Words ``w3`` ..., the tile tokens, the two newlines and ``<image>`` at the model's image id."""
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    names = ["<unk>", "<s>", "</s>", *(f"w{i}" for i in range(3, 100)), *SPECIAL, "\n", "\n\n"]
    names += [f"x{i}" for i in range(len(names), IMAGE_TOKEN)] + ["<image>"]
    tok = Tokenizer(models.WordLevel({n: i for i, n in enumerate(names)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.add_special_tokens([AddedToken(t, normalized=False) for t in [*SPECIAL, "<image>", "\n\n", "\n"]])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        chat_template="{% for m in messages %}{{ m['content'] }} {% endfor %}",
    )
    fast.save_pretrained(out)


@pytest.fixture(scope="module")
def split_engine(tmp_path_factory: pytest.TempPathFactory):
    out = save_vlm(
        hf_vlm("idefics3", "siglip", seed=5), Path(tmp_path_factory.mktemp("smolvlm")), PREPROCESSOR
    )
    save_tokenizer(out)
    loaded = load_model(out)
    vision = loaded.vision
    assert vision.preprocess.split and vision.split_tokens is not None and len(vision.wrap) == 2
    with Engine(loaded, **ENGINE) as engine:
        yield engine


def chat(client: TestClient, image: str, max_tokens: int | None = None):
    body: dict = {
        "model": "m",
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "w3 w4 w5 w6 w7"},
                    {"type": "image_url", "image_url": {"url": image}},
                    {"type": "text", "text": "w8 w9"},
                ],
            }
        ],  # fmt: skip
        "temperature": 0,
    }
    if max_tokens is not None:
        body["max_tokens"] = max_tokens
    return client.post("/v1/chat/completions", json=body)


def test_image_prompt_tokens_equal_the_built_prompt(split_engine: Engine):
    """`prompt_tokens` (from the size) equals the tokens `build` lays out for the image (from its pixels)."""
    vision = split_engine.model.vision
    n = vision.cfg.tokens_per_image
    for size in [*SIZES, (20, 20)]:
        image = make_image(sum(size), size)
        rows, cols = vision.preprocess.tiles(image).rows, vision.preprocess.tiles(image).cols
        built, _ = vision.build([3, IMAGE_TOKEN, 4], [image])
        assert vision.prompt_tokens(image) == len(built) - 2
        if rows:  # per tile <fake><row_r_col_c> + span, a newline per row, <fake><global-img> span <fake>
            assert vision.prompt_tokens(image) == rows * cols * (2 + n) + rows + n + 3
        else:
            assert vision.prompt_tokens(image) == n + 3


def test_split_image_prompt_too_long_is_400_and_one_that_fits_is_served(split_engine: Engine):
    vision = split_engine.model.vision
    image = make_image(7, SIZES[0])  # 2 x 2 tiles: 4 x (2 + 4) + 2 newlines + 7 = 33 tokens, not 7
    assert vision.prompt_tokens(image) == 33
    with TestClient(
        create_app(split_engine, ServerConfig(served_model_name="m", context_length=200))
    ) as client:
        ok = chat(client, data_url(image), max_tokens=1)
        assert ok.status_code == 200, ok.text
        prompt_tokens = ok.json()["usage"]["prompt_tokens"]
    assert prompt_tokens == 7 + 33  # seven words and the image
    # served with exactly room for one token: fits; the default max_tokens fills the context
    with TestClient(
        create_app(split_engine, ServerConfig(served_model_name="m", context_length=prompt_tokens + 1))
    ) as client:
        fits = chat(client, data_url(image))
        assert fits.status_code == 200, fits.text
        usage = fits.json()["usage"]
        assert usage["prompt_tokens"] == prompt_tokens and usage["completion_tokens"] == 1
    # one token short: the prompt alone fills the context (counted with one span per image it would
    # have looked 26 tokens shorter and passed)
    with TestClient(
        create_app(split_engine, ServerConfig(served_model_name="m", context_length=prompt_tokens))
    ) as client:
        long = chat(client, data_url(image))
        assert long.status_code == 400
        err = long.json()["error"]
        assert (
            err["code"] == "context_length_exceeded"
            and f"the prompt has {prompt_tokens} tokens" in err["message"]
        )
        again = chat(client, data_url(image), max_tokens=1)  # asks for one more token than fits
        assert again.status_code == 400 and again.json()["error"]["code"] == "context_length_exceeded"
    split_engine.check_invariants()
