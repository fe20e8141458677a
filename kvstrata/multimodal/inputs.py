"""Image-hash tokens and per-request image features.

`VisionLanguage` is what the engine holds for a vision-language model: it turns ``image_data`` into
placeholder spans and runs the encoder. Each image's placeholder tokens are replaced by a *pad id*
derived from the SHA-256 of its preprocessed pixels (``vocab_size + 56 bits of the hash``, so it
never equals a real token): two requests with the same image share the span's pages through the
radix tree, and different images never do (as SGLang's ``pad_value``).

`MultimodalInput` belongs to one request. The step runner asks it for the feature rows of the
positions a step computes (``rows``). On its first step it decides, per image: a span that the
prefix match already covers needs nothing (its K/V is cached); a span whose only missing rows are
its tail (the last page of a cached image is shared with the text that follows it, so the tree holds
only the full pages before it) takes those rows from the encoder's small tail store; everything else
runs the tower, once per batch of images. Counters: ``encoded_images`` (tower runs, per image) and
``cached_images`` (images whose tower run was skipped); an Idefics3 image cut into tiles is one span
per tile and one for its global image, each counted as an image.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor

from kvstrata.multimodal.images import ImageLimits, load_image
from kvstrata.multimodal.model import VisionEncoder, VLMConfig
from kvstrata.multimodal.preprocess import Preprocessor, Tiles, content_hash
from kvstrata.radix.errors import PinBudgetExceeded

log = logging.getLogger("kvstrata.multimodal")

TAIL_ROWS = 64  # feature rows kept per image: covers the unshared last page of any page size <= 64
TAIL_ENTRIES = 128  # images remembered (LRU): 64 MiB at most for a 4096-wide bfloat16 model


@dataclass
class ImageSpan:
    digest: bytes
    pad_id: int
    start: int  # first placeholder position in the prompt
    length: int
    pixels: Tensor | None
    offset: int = 0  # features cover span rows [offset, length)
    features: Tensor | None = None
    last: bool = True  # the image's last span (its global image when split): its pin ends here

    @property
    def end(self) -> int:
        return self.start + self.length


@dataclass
class VisionStats:
    encoded_images: int = 0
    cached_images: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, encoded: int, cached: int) -> None:
        with self.lock:
            self.encoded_images += encoded
            self.cached_images += cached


@dataclass(frozen=True)
class SplitTokens:
    """Idefics3's text around tiles: ``<row_r_col_c>`` ids (``row_col[r][c]``, 0-based), the ids of
    ``"\n"`` after a row of tiles and of ``"\n\n"`` after the last row (each between special
    tokens, so tokenized alone)."""

    row_col: tuple[tuple[int, ...], ...]
    newline: tuple[int, ...]
    last_newline: tuple[int, ...]


class VisionLanguage:
    def __init__(
        self,
        cfg: VLMConfig,
        encoder: VisionEncoder,
        preprocess: Preprocessor,
        vocab_size: int,
        extra_tokens: Sequence[int] = (),
        limits: ImageLimits | None = None,
        split_tokens: SplitTokens | None = None,
    ) -> None:
        self.cfg = cfg
        self.split_tokens = split_tokens
        self.encoder = encoder
        self.preprocess = preprocess
        self.vocab_size = vocab_size
        self.wrap = tuple(extra_tokens)  # idefics3: (fake, global-img) around each span
        self.limits = limits or ImageLimits()
        self.stats = VisionStats()
        self._tails: OrderedDict[int, Tensor] = OrderedDict()

    def set_limits(
        self, max_bytes: int, max_pixels: int, fetch_timeout_s: float, hosts: frozenset[str]
    ) -> None:
        self.limits = ImageLimits(max_bytes, max_pixels, fetch_timeout_s, hosts)

    @property
    def image_token_id(self) -> int:
        return self.cfg.image_token_id

    @property
    def max_image_tokens(self) -> int:
        """Prompt positions one image may take: its tiles and global image when split."""
        spans = self.preprocess.max_grid**2 + 1 if self.preprocess.split else 1
        return spans * self.cfg.tokens_per_image

    def prompt_tokens(self, image: Any) -> int:
        """Prompt positions one image (PIL) takes in place of its image token, counted from its size
        as `_place` lays them out (tiles when the preprocessor splits it), without running anything."""
        n = self.cfg.tokens_per_image
        wrap = len(self.wrap) + 1 if self.wrap else 0
        rows, cols = self.preprocess.grid(image.height, image.width)
        split = self.split_tokens
        if not rows or split is None:
            return n + wrap
        newlines = (rows - 1) * len(split.newline) + len(split.last_newline)
        return rows * cols * (2 + n) + newlines + n + wrap

    def pad_id(self, digest: bytes) -> int:
        return self.vocab_size + int.from_bytes(digest[:7], "big")

    # --- request side (caller thread) -------------------------------------------------------------
    def build(self, ids: list[int], image_data: Sequence[Any]) -> tuple[list[int], MultimodalInput]:
        """Expand each ``<image>`` token of ``ids`` into its span of pad ids; one image per token.

        Raises ``ValueError`` (``ImageError`` for a bad image) when the counts differ or an image fails.
        """
        slots = [i for i, t in enumerate(ids) if t == self.image_token_id]
        if len(slots) != len(image_data):
            raise ValueError(
                f"the prompt has {len(slots)} image tokens (id {self.image_token_id}) "
                f"for {len(image_data)} images"
            )
        tiles = [self.preprocess.tiles(load_image(src, self.limits)) for src in image_data]
        if any(t.rows for t in tiles) and (self.split_tokens is None or len(self.wrap) != 2):
            raise ValueError(
                "this model splits images into tiles: it needs the tokenizer's <fake_token_around_image>, "
                "<global-img> and <row_r_col_c> tokens"
            )
        out: list[int] = []
        spans: list[ImageSpan] = []
        prev = 0
        for slot, image in zip(slots, tiles, strict=True):
            out.extend(ids[prev:slot])
            self._place(image, out, spans)
            prev = slot + 1
        out.extend(ids[prev:])
        return out, MultimodalInput(self, spans)

    def _place(self, tiles: Tiles, out: list[int], spans: list[ImageSpan]) -> None:
        """Append one image's tokens to ``out`` and its spans to ``spans``: per tile ``<fake>
        <row_r_col_c>`` + placeholders (a newline after each row), then the global image as
        ``<fake><global-img>`` + placeholders + ``<fake>`` (the wrap tokens when the model has them),
        as transformers' Idefics3 processor writes the prompt."""
        n = self.cfg.tokens_per_image

        def span(pixels: Tensor, last: bool) -> None:
            digest = content_hash(pixels)
            pad = self.pad_id(digest)
            spans.append(ImageSpan(digest, pad, len(out), n, pixels, last=last))
            out.extend([pad] * n)

        split = self.split_tokens
        for r in range(tiles.rows):
            assert split is not None
            for c in range(tiles.cols):
                out.extend((self.wrap[0], split.row_col[r][c]))
                span(tiles.pixels[r * tiles.cols + c], last=False)
            out.extend(split.newline if r < tiles.rows - 1 else split.last_newline)
        if self.wrap:
            out.extend(self.wrap)
        span(tiles.pixels[-1], last=True)
        if self.wrap:
            out.append(self.wrap[0])

    # --- engine thread --------------------------------------------------------------------------------
    def encode(self, pixels: list[Tensor]) -> Tensor:
        """[B, tokens_per_image, text_hidden] features, in the encoder's dtype."""
        p = next(self.encoder.parameters())
        with torch.inference_mode():
            return self.encoder(torch.stack(pixels).to(device=p.device, dtype=p.dtype))

    def remember_tail(self, pad: int, features: Tensor) -> None:
        self._tails[pad] = features[-TAIL_ROWS:].clone()
        self._tails.move_to_end(pad)
        while len(self._tails) > TAIL_ENTRIES:
            self._tails.popitem(last=False)

    def tail(self, pad: int) -> Tensor | None:
        return self._tails.get(pad)


class MultimodalInput:
    def __init__(self, owner: VisionLanguage, spans: list[ImageSpan]) -> None:
        self.owner = owner
        self.spans = spans
        self.started = False
        self.pinned = False  # pin_spans ran (pins made, or refused and counted)

    def fork(self) -> MultimodalInput:
        """The same images for another request (n > 1): pixels shared, features its own."""
        return MultimodalInput(
            self.owner,
            [ImageSpan(s.digest, s.pad_id, s.start, s.length, s.pixels, last=s.last) for s in self.spans],
        )

    @property
    def pad_ids(self) -> frozenset[int]:
        return frozenset(s.pad_id for s in self.spans)

    def text_ids(self, ids: Sequence[int]) -> list[int]:
        vocab = self.owner.vocab_size
        return [t for t in ids if t < vocab]

    def _plan(self, computed: int) -> None:
        """First step: decide per image whether the tower must run (see the module docstring)."""
        self.started = True
        todo: list[ImageSpan] = []
        cached = 0
        for span in self.spans:
            if span.end <= computed:
                cached += 1
                continue
            need_from = max(computed - span.start, 0)
            tail = self.owner.tail(span.pad_id)
            if need_from > 0 and tail is not None and need_from >= span.length - len(tail):
                span.offset, span.features = span.length - len(tail), tail
                cached += 1
            else:
                todo.append(span)
        self._encode(todo)
        self.owner.stats.add(0, cached)

    def _encode(self, todo: list[ImageSpan]) -> None:
        if not todo:
            return
        features = self.owner.encode([s.pixels for s in todo])  # type: ignore[misc]
        for span, f in zip(todo, features, strict=True):
            span.offset, span.features = 0, f
            self.owner.remember_tail(span.pad_id, f)
        self.owner.stats.add(len(todo), 0)

    def rows(self, start: int, end: int) -> list[tuple[int, Tensor]]:
        """Feature rows for prompt positions [start, end): (index from ``start``, rows) per image."""
        if not self.started:
            self._plan(start)
        out = []
        for span in self.spans:
            lo, hi = max(start, span.start), min(end, span.end)
            if lo >= hi:
                continue
            if span.features is None or lo - span.start < span.offset:  # e.g. its pages were evicted
                self._encode([span])
            assert span.features is not None
            first = lo - span.start - span.offset
            out.append((lo - start, span.features[first : first + hi - lo]))
        return out

    def pin_spans(self, prompt_ids: Sequence[int], pins: Any, ttl_s: float | None) -> None:
        """Pin the cached prefix ending at each image span (its full pages; a span inside the first
        page has none). A full pin budget refuses the pin (counted by the table); the request goes on."""
        self.pinned = True
        for span in self.spans:
            if not span.last or span.end < pins.cache.page_size:
                continue
            try:
                pins.pin(prompt_ids[: span.end], kind="image", label=span.digest.hex()[:16], ttl_s=ttl_s)
            except (PinBudgetExceeded, ValueError) as exc:
                log.warning("image %s not pinned: %s", span.digest.hex()[:16], exc)
        self.release()

    def release(self) -> None:
        """Drop pixels and features once the prompt is computed (the K/V holds what they gave)."""
        for span in self.spans:
            span.features = None
