"""Image input: ``data:`` URLs always, ``http(s)`` only for allow-listed hosts, under hard limits.

Every way an image can be wrong (not an image, truncated, too large in bytes or pixels, a remote URL
while fetching is off, a host not on the allow-list, a slow server) raises `ImageError`, a
``ValueError`` whose message the server returns as a 400. The pixel limit is checked on the header
before any pixel is decoded (the decompression-bomb guard), and again by Pillow's own guard.
"""

from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
import warnings
from dataclasses import dataclass, field
from typing import Any

from PIL import Image

DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_FETCH_TIMEOUT_S = 10.0


class ImageError(ValueError):
    """A bad image input; the message says which limit or check it failed."""


@dataclass(frozen=True)
class ImageLimits:
    """What an image may be. ``allowed_hosts`` empty: http(s) URLs are refused (fetching is off)."""

    max_bytes: int = DEFAULT_MAX_BYTES
    max_pixels: int = DEFAULT_MAX_PIXELS
    fetch_timeout_s: float = DEFAULT_FETCH_TIMEOUT_S
    allowed_hosts: frozenset[str] = field(default_factory=frozenset)


def load_image(source: Any, limits: ImageLimits | None = None) -> Image.Image:
    """A PIL image (RGB, fully decoded) from a ``data:`` URL, an http(s) URL, raw bytes or a PIL image."""
    limits = limits or ImageLimits()
    if isinstance(source, Image.Image):
        _check_pixels(source.size, limits)
        return source.convert("RGB")
    if isinstance(source, (bytes, bytearray)):
        return decode_image(bytes(source), limits)
    if not isinstance(source, str):
        raise ImageError(f"an image must be a URL string, bytes or a PIL image, not {type(source).__name__}")
    if source.startswith("data:"):
        return decode_image(_data_url_bytes(source, limits), limits)
    scheme = urllib.parse.urlsplit(source).scheme.lower()
    if scheme in ("http", "https"):
        return decode_image(_fetch(source, limits), limits)
    raise ImageError("an image URL must be a data: URL (data:image/png;base64,...) or an http(s) URL")


def _data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep:
        raise ImageError("malformed data: URL: no ',' before the payload")
    if not header.endswith(";base64"):
        raise ImageError("a data: URL image must be base64 encoded (data:image/...;base64,...)")
    if len(payload) * 3 // 4 > limits.max_bytes:
        raise ImageError(f"the image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"the data: URL payload is not valid base64: {exc}") from exc


def _fetch(url: str, limits: ImageLimits) -> bytes:
    host = (urllib.parse.urlsplit(url).hostname or "").lower()
    if not limits.allowed_hosts:
        raise ImageError("fetching remote images is off on this server; send the image as a data: URL")
    if host not in limits.allowed_hosts:
        raise ImageError(f"the host {host!r} is not on this server's image allow-list")
    request = urllib.request.Request(url, headers={"User-Agent": "kvstrata"})
    try:
        with urllib.request.urlopen(request, timeout=limits.fetch_timeout_s) as response:  # noqa: S310
            data = response.read(limits.max_bytes + 1)
    except TimeoutError as exc:
        raise ImageError(f"fetching the image timed out after {limits.fetch_timeout_s} s") from exc
    except OSError as exc:  # URLError, HTTPError, connection errors
        raise ImageError(f"could not fetch the image: {exc}") from exc
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is larger than {limits.max_bytes} bytes")
    return data


def _check_pixels(size: tuple[int, int], limits: ImageLimits) -> None:
    w, h = size
    if w <= 0 or h <= 0:
        raise ImageError(f"the image has no pixels ({w}x{h})")
    if w * h > limits.max_pixels:
        raise ImageError(
            f"the image has {w}x{h} = {w * h} pixels, more than the limit of {limits.max_pixels}"
        )


def decode_image(data: bytes, limits: ImageLimits) -> Image.Image:
    if len(data) > limits.max_bytes:
        raise ImageError(f"the image is larger than {limits.max_bytes} bytes")
    if not data:
        raise ImageError("the image is empty")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            _check_pixels(image.size, limits)  # from the header: before any pixel is decoded
            image.load()
    except ImageError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageError(f"the image is too large to decode safely: {exc}") from exc
    except Exception as exc:  # UnidentifiedImageError, truncated data (OSError), corrupt headers
        raise ImageError(f"the data is not a readable image: {exc}") from exc
    return image.convert("RGB")
