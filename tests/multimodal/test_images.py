"""Image loading limits and preprocessing against transformers' image processors."""

from __future__ import annotations

import base64
import io
import threading
from http.server import BaseHTTPRequestHandler, HTTPServer

import numpy as np
import pytest
import torch
from PIL import Image

from kvstrata.multimodal.images import ImageError, ImageLimits, load_image
from kvstrata.multimodal.preprocess import Preprocessor

from .tiny_vlm import data_url, make_image, png_bytes


def test_data_url_round_trip():
    image = make_image(3)
    got = load_image(data_url(image))
    assert got.size == image.size and np.array_equal(np.asarray(got), np.asarray(image))


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "data:image/png;base64," + base64.b64encode(b"not an image at all").decode(),
            "not a readable image",
        ),
        (
            "data:image/png;base64," + base64.b64encode(png_bytes(make_image(1))[:60]).decode(),
            "not a readable",
        ),
        ("data:image/png;base64,@@@", "not valid base64"),
        ("data:image/png,rawdata", "base64 encoded"),
        ("https://example.com/cat.png", "fetching remote images is off"),
        ("file:///etc/passwd", "data: URL"),
        (b"", "empty"),
    ],
)
def test_bad_images_raise_image_error(source, message):
    with pytest.raises(ImageError, match=message):
        load_image(source)


def test_pixel_limit_checked_before_decoding():
    big = Image.new("RGB", (3000, 2000))
    buf = io.BytesIO()
    big.save(buf, format="PNG")  # a few KB: a decompression bomb in miniature
    with pytest.raises(ImageError, match="6000000 pixels, more than the limit of 1000000"):
        load_image(buf.getvalue(), ImageLimits(max_pixels=1_000_000))
    with pytest.raises(ImageError, match="larger than 100 bytes"):
        load_image(buf.getvalue(), ImageLimits(max_bytes=100))


class _Handler(BaseHTTPRequestHandler):
    body = b""

    def do_GET(self) -> None:  # noqa: N802
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *args: object) -> None:
        pass


def test_allow_listed_fetch_and_refused_host():
    image = make_image(4)
    _Handler.body = png_bytes(image)
    server = HTTPServer(("127.0.0.1", 0), _Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_port}/img.png"
        allowed = ImageLimits(allowed_hosts=frozenset({"127.0.0.1"}))
        assert np.array_equal(np.asarray(load_image(url, allowed)), np.asarray(image))
        with pytest.raises(ImageError, match="not on this server's image allow-list"):
            load_image(url, ImageLimits(allowed_hosts=frozenset({"example.com"})))
        with pytest.raises(ImageError, match="larger than 50 bytes"):
            load_image(url, ImageLimits(max_bytes=50, allowed_hosts=frozenset({"127.0.0.1"})))
    finally:
        server.shutdown()


@pytest.mark.parametrize("kind", ["clip", "siglip"])
def test_preprocessing_equals_transformers(kind):
    import transformers

    if kind == "clip":
        hf = transformers.CLIPImageProcessor(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
    else:
        hf = transformers.SiglipImageProcessor(size={"height": 32, "width": 32})
    ours = Preprocessor.from_hf(hf.to_dict(), 32)
    for seed, size in ((0, (50, 37)), (1, (20, 64))):
        image = make_image(seed, size)
        ref = torch.as_tensor(np.asarray(hf(image, return_tensors="np")["pixel_values"][0]))
        torch.testing.assert_close(ours(image), ref.float(), atol=1e-5, rtol=0)
