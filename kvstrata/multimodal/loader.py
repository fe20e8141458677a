"""Load a vision-language Hugging Face directory: the Llama-family LM as the engine's `Transformer`,
the tower + connector as a `VisionEncoder`, preprocessing from ``preprocessor_config.json``."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import torch

from kvstrata.engine.loader import LoadedModel, build_model, load_tokenizer, read_config, read_safetensors
from kvstrata.multimodal.chat import adopt_processor_template
from kvstrata.multimodal.images import ImageLimits
from kvstrata.multimodal.inputs import SplitTokens, VisionLanguage
from kvstrata.multimodal.model import VisionEncoder, VLMConfig, split_state_dict
from kvstrata.multimodal.preprocess import Preprocessor

IDEFICS3_WRAP = ("<fake_token_around_image>", "<global-img>")
log = logging.getLogger("kvstrata.multimodal")


def load_vlm(
    model_dir: Path, name: str, dtype: torch.dtype, device: torch.device, limits: ImageLimits | None = None
) -> LoadedModel:
    raw = complete_config(model_dir, json.loads((model_dir / "config.json").read_text()))
    vlm = VLMConfig.from_hf(raw)
    text = dict(raw["text_config"])
    text.setdefault("model_type", "llama")
    text.setdefault("tie_word_embeddings", raw.get("tie_word_embeddings", False))
    config = read_config(model_dir, text)
    lm_state, enc_state = split_state_dict(read_safetensors(model_dir), vlm.family)
    net = build_model(config, lm_state, dtype, device)
    with torch.device("meta"):
        encoder = VisionEncoder(vlm, config.hidden_size)
    cast = {k: v.to(device=device, dtype=dtype) for k, v in enc_state.items()}
    encoder.load_state_dict(cast, strict=True, assign=True)
    encoder = encoder.eval().requires_grad_(False)
    tokenizer = load_tokenizer(model_dir)
    adopt_processor_template(tokenizer, model_dir)
    wrap: tuple[int, ...] = ()
    if vlm.family == "idefics3" and tokenizer is not None:
        ids = tokenizer.convert_tokens_to_ids(list(IDEFICS3_WRAP))
        if None not in ids and tokenizer.unk_token_id not in ids:
            wrap = tuple(ids)
    preprocess = Preprocessor.from_dir(model_dir, vlm.vision.image_size)
    split = None
    if preprocess.split and tokenizer is not None:
        split = split_tokens(tokenizer, preprocess.max_grid)
        if split is None or not wrap:
            log.warning("%s: the tokenizer lacks Idefics3's tile tokens; images are not split", model_dir)
            preprocess = dataclasses.replace(preprocess, split=False)
    vision = VisionLanguage(
        vlm,
        encoder,
        preprocess,
        config.vocab_size,
        extra_tokens=wrap,
        limits=limits,
        split_tokens=split,
    )
    return LoadedModel(net=net, config=config, tokenizer=tokenizer, name=name, path=model_dir, vision=vision)


def split_tokens(tokenizer: Any, grid: int) -> SplitTokens | None:
    """The ids of ``<row_r_col_c>`` for a ``grid x grid`` layout and of the newlines between rows, or
    None when the tokenizer lacks a tile token."""
    names = [[f"<row_{r + 1}_col_{c + 1}>" for c in range(grid)] for r in range(grid)]
    rows = [tokenizer.convert_tokens_to_ids(row) for row in names]
    if any(i is None or i == tokenizer.unk_token_id for row in rows for i in row):
        return None
    newline = tokenizer.encode("\n", add_special_tokens=False)
    last = tokenizer.encode("\n\n", add_special_tokens=False)
    return SplitTokens(tuple(tuple(r) for r in rows), tuple(newline), tuple(last))


def complete_config(model_dir: Path, raw: dict[str, Any]) -> dict[str, Any]:
    """Published checkpoints list only the sub-config fields that differ from transformers' defaults
    (``llava-hf/llava-1.5-7b-hf``'s ``text_config`` has no ``hidden_size``): fill them in from
    transformers' config classes, which know those defaults."""
    from transformers import AutoConfig

    full = AutoConfig.from_pretrained(str(model_dir))
    out = dict(raw)
    for name in ("text_config", "vision_config"):
        sub = getattr(full, name, None)
        if sub is not None:
            out[name] = {**sub.to_dict(), **raw.get(name, {})}
    return out
