"""Tiny random LLaVA and Idefics3 checkpoints built with transformers at test time, and test images."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

from tests.engine.tiny_models import TINY, randomize_

IMAGE_TOKEN = 299  # the last id of the tiny vocabulary
VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4, patch_size=7)


def hf_vlm(family: str, vision_kind: str = "clip", seed: int = 0, **vision_overrides: Any) -> torch.nn.Module:
    """``llava`` (CLIP or SigLIP tower, 16 image tokens) or ``idefics3`` (SigLIP, pixel shuffle: 4 tokens)."""
    import transformers

    text = transformers.LlamaConfig(**TINY, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    if family == "llava":
        vcls = transformers.CLIPVisionConfig if vision_kind == "clip" else transformers.SiglipVisionConfig
        vision = vcls(**{**VISION, "image_size": 28, **vision_overrides})
        cfg = transformers.LlavaConfig(
            vision_config=vision,
            text_config=text,
            image_token_index=IMAGE_TOKEN,
            vision_feature_layer=-2,
            vision_feature_select_strategy="default" if vision_kind == "clip" else "full",
            image_seq_length=16,
        )
        cls = transformers.LlavaForConditionalGeneration
    else:
        vision = transformers.Idefics3VisionConfig(**VISION, image_size=28)
        cfg = transformers.Idefics3Config(
            vision_config=vision, text_config=text, image_token_id=IMAGE_TOKEN, scale_factor=2
        )
        cls = transformers.Idefics3ForConditionalGeneration
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    randomize_(model, seed)
    return model


def save_vlm(model: torch.nn.Module, out: Path, preprocessor: dict[str, Any] | None = None) -> Path:
    model.save_pretrained(out, safe_serialization=True)
    pre = preprocessor or {
        "size": {"height": 28, "width": 28},
        "resample": 2,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    (out / "preprocessor_config.json").write_text(json.dumps(pre))
    return out


def make_image(seed: int, size: tuple[int, int] = (40, 30)) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def data_url(image: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(image)).decode()
