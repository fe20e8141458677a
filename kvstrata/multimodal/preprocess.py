"""Image preprocessing as transformers' (PIL-based) CLIP / SigLIP / Idefics3 image processors do it:
resize, optional center crop, rescale to [0, 1], normalize. Settings come from a model directory's
``preprocessor_config.json``; the result is one float32 ``[3, H, W]`` tensor per image.

Idefics3 / SmolVLM (``size: {"longest_edge": ...}``) resize the longest edge first; with
``do_image_splitting`` the image is then resized to multiples of the tower's square
(``max_image_size``), cut into ``rows x cols`` tiles, and followed by the whole image resized to one
square (the global image): `Preprocessor.tiles`. Every resize works on the 8-bit image, as
transformers' PIL backend does.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
MAX_IMAGE_SIDE = 4096  # transformers' Idefics3 bound on a resized side


@dataclass(frozen=True)
class Tiles:
    """One image as the tower sees it: ``rows x cols`` tiles (row-major) then the global image, or
    the image alone (``rows == cols == 0``)."""

    pixels: list[torch.Tensor]
    rows: int
    cols: int


def fit_longest_edge(height: int, width: int, longest: int) -> tuple[int, int]:
    """Idefics3's output size: the longest edge becomes ``longest`` (the other rounded up to even),
    then both kept within `MAX_IMAGE_SIDE`."""
    aspect = width / height
    if width >= height:
        width, height = longest, int(longest / aspect)
        height += height % 2
    else:
        height, width = longest, int(longest * aspect)
        width += width % 2
    height, width = max(height, 1), max(width, 1)
    aspect = width / height
    if width >= height and width > MAX_IMAGE_SIDE:
        width, height = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE / aspect)
    elif height > width and height > MAX_IMAGE_SIDE:
        height, width = MAX_IMAGE_SIDE, int(MAX_IMAGE_SIDE * aspect)
    return max(height, 1), max(width, 1)


def multiple_of_tile(height: int, width: int, tile: int) -> tuple[int, int]:
    """Idefics3's size before splitting: the longest edge rounded up to a multiple of ``tile``, the
    other edge scaled with it, then rounded up as well."""
    aspect = width / height
    if width >= height:
        width = math.ceil(width / tile) * tile
        height = math.ceil(int(width / aspect) / tile) * tile
    else:
        height = math.ceil(height / tile) * tile
        width = math.ceil(int(height * aspect) / tile) * tile
    return height, width


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
    longest_edge: int | None = None  # Idefics3: resize the longest edge to this first (do_resize)
    split: bool = False  # Idefics3 image splitting into tiles of height x width plus a global image

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
        else:  # Idefics3 ("longest_edge"): tiles and the global image are the tower's square
            height = width = int((d.get("max_image_size") or {}).get("longest_edge", image_size))
        longest = size.get("longest_edge") if d.get("do_resize", True) else None
        return cls(
            height=height,
            width=width,
            shortest_edge=shortest,
            center_crop=do_crop,
            resample=int(d.get("resample", Image.Resampling.BICUBIC)),
            rescale_factor=float(d.get("rescale_factor", 1 / 255)),
            mean=tuple(d.get("image_mean", CLIP_MEAN)),
            std=tuple(d.get("image_std", CLIP_STD)),
            longest_edge=int(longest) if longest else None,
            split=bool(d.get("do_image_splitting", True)) and "longest_edge" in size,
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

    @property
    def max_grid(self) -> int:
        """The most rows (or columns) of tiles an image can be cut into."""
        return math.ceil((self.longest_edge or MAX_IMAGE_SIDE) / self.height)

    def grid(self, height: int, width: int) -> tuple[int, int]:
        """Rows and columns of tiles an image of ``height x width`` pixels is cut into ((0, 0): not
        split), from its size alone: what `tiles` cuts, without touching pixels (the server counts an
        image's prompt tokens with it before anything runs)."""
        if not self.split:
            return 0, 0
        if self.longest_edge is not None:
            height, width = fit_longest_edge(height, width, self.longest_edge)
        t = self.height
        h, w = multiple_of_tile(height, width, t)
        if h <= t and w <= t:
            return 0, 0
        return (h - t) // t + 1, (w - t) // t + 1

    def tiles(self, image: Image.Image) -> Tiles:
        """The image as tiles plus its global image (Idefics3 splitting), or as itself."""
        image = image.convert("RGB")
        rows, cols = self.grid(image.height, image.width)
        if self.longest_edge is not None:
            h, w = fit_longest_edge(image.height, image.width, self.longest_edge)
            image = image.resize((w, h), resample=self.resample)
        if not self.split:
            return Tiles([self._to_tower(image)], 0, 0)
        t = self.height
        h, w = multiple_of_tile(image.height, image.width, t)
        image = image.resize((w, h), resample=self.resample)
        if not rows:
            return Tiles([self._normalize(image)], 0, 0)
        crops = [image.crop((c * t, r * t, c * t + t, r * t + t)) for r in range(rows) for c in range(cols)]
        crops.append(image.resize((t, t), resample=self.resample))
        return Tiles([self._normalize(c) for c in crops], rows, cols)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        """The tower's input for ``image`` (with splitting: its global image)."""
        return self.tiles(image).pixels[-1]

    def _to_tower(self, image: Image.Image) -> torch.Tensor:
        """Resize (or resize and crop) to the tower's input, then rescale and normalize."""
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
        return self._normalize(image)

    def _normalize(self, image: Image.Image) -> torch.Tensor:
        pixels = np.asarray(image, dtype=np.float32) * np.float32(self.rescale_factor)
        pixels = (pixels - np.asarray(self.mean, np.float32)) / np.asarray(self.std, np.float32)
        return torch.from_numpy(np.ascontiguousarray(pixels.transpose(2, 0, 1)))


def content_hash(pixels: torch.Tensor) -> bytes:
    """The image's identity: SHA-256 of its preprocessed pixels (equal pixels give equal features)."""
    return hashlib.sha256(pixels.contiguous().numpy().tobytes()).digest()
