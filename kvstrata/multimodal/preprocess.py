"""Image preprocessing as transformers' (slow, PIL-based) CLIP / SigLIP / Idefics3 image processors do it:
resize, optional center crop, rescale to [0, 1], normalize. Settings come from a model directory's
``preprocessor_config.json``; the result is one float32 ``[3, H, W]`` tensor per image.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class Preprocessor:
    height: int  # of the output
    width: int
    shortest_edge: int | None = None  # resize the short side to this (aspect kept), else to height x width
    center_crop: bool = False
    resample: int = int(Image.Resampling.BICUBIC)
    rescale_factor: float = 1 / 255
    mean: tuple[float, ...] = CLIP_MEAN
    std: tuple[float, ...] = CLIP_STD

    @classmethod
    def from_hf(cls, d: dict[str, Any], image_size: int) -> Preprocessor:
        size = d.get("size") or {}
        crop = d.get("crop_size") or {}
        do_crop = bool(d.get("do_center_crop", False))
        shortest = size.get("shortest_edge")
        if shortest is not None:
            height = int(crop.get("height", shortest)) if do_crop else int(shortest)
            width = int(crop.get("width", shortest)) if do_crop else int(shortest)
        elif "height" in size:
            height, width = int(size["height"]), int(size["width"])
        else:  # Idefics3 ("longest_edge") without image splitting: the tower's own square
            height = width = image_size
        return cls(
            height=height,
            width=width,
            shortest_edge=shortest,
            center_crop=do_crop,
            resample=int(d.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            mean=tuple(d.get("image_mean", CLIP_MEAN)),
            std=tuple(d.get("image_std", CLIP_STD)),
        )

    @classmethod
    def from_dir(cls, model_dir: Path, image_size: int) -> Preprocessor:
        path = Path(model_dir) / "preprocessor_config.json"
        d = (
            json.loads(path.read_text())
            if path.is_file()
            else {"size": {"height": image_size, "width": image_size}}
        )
        return cls.from_hf(d, image_size)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        image = image.convert("RGB")
        if self.shortest_edge is not None:
            w, h, s = *image.size, self.shortest_edge
            new_size = (s, int(s * h / w)) if w <= h else (int(s * w / h), s)
            image = image.resize(new_size, resample=self.resample)
        else:
            image = image.resize((self.width, self.height), resample=self.resample)
        if self.center_crop:
            w, h = image.size
            top, left = (h - self.height) // 2, (w - self.width) // 2
            image = image.crop((left, top, left + self.width, top + self.height))
        pixels = np.asarray(image, dtype=np.float32) * np.float32(self.rescale_factor)
        pixels = (pixels - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def content_hash(pixels: torch.Tensor) -> bytes:
    """The image's identity: SHA-256 of its preprocessed pixels (equal pixels give equal features)."""
    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).digest()
