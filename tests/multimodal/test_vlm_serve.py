"""End to end: ``kvstrata serve --model DIR`` with the assembled LLaVA-style model and the openai client:
the same image in two turns, cached image tokens, pins in /v1/cache and /metrics, bad images, pin API."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.multimodal.assemble import assemble

from .tiny_vlm import data_url, make_image, png_bytes

PAGE = 16
IMAGE_TOKENS = 64


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module", params=["off", "on"], ids=["one-process", "engine-process"])
def server(tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest) -> Iterator[str]:
    """The server in one process, then with the engine in its own (images, pins and the tower's counters
    then cross the pipe)."""
    model_dir = assemble(Path(tmp_path_factory.mktemp("assembled")))
    port = _free_port()
    env = dict(os.environ, KVSTRATA_LOG_LEVEL="warning")
    cmd = [sys.executable, "-m", "kvstrata", "serve", "--model", str(model_dir), "--port", str(port)]
    cmd += ["--max-total-tokens", "4096", "--served-model-name", "vlm", "--engine-process", request.param]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvstrata serve did not come up"
            time.sleep(0.25)
        yield url
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


def metric(url: str, name: str) -> float:
    for family in text_string_to_metric_families(httpx.get(url + "/metrics").text):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise KeyError(name)


def test_same_image_in_two_turns_is_cached_and_pinned(server: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(21, (320, 240)))}}
    turn1 = [{"role": "user", "content": [image, {"type": "text", "text": "What is in this picture?"}]}]
    first = client.chat.completions.create(model="vlm", messages=turn1, max_tokens=6, temperature=0)
    assert first.usage.prompt_tokens > IMAGE_TOKENS
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    reply = first.choices[0].message.content
    turn2 = [*turn1, {"role": "assistant", "content": reply}, {"role": "user", "content": "And its colors?"}]
    second = client.chat.completions.create(model="vlm", messages=turn2, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    # every full page of turn 1's prompt, the image span included, is read from the cache
    assert cached >= first.usage.prompt_tokens // PAGE * PAGE > IMAGE_TOKENS

    cache = httpx.get(server + "/v1/cache").json()
    image_pins = [p for p in cache["pins"] if p["kind"] == "image"]
    assert len(image_pins) == 1 and image_pins[0]["tokens"] >= IMAGE_TOKENS // PAGE * PAGE
    assert cache["pinned_pages"] == image_pins[0]["pages"] and cache["pinned_bytes"] == image_pins[0]["bytes"]
    assert cache["vision"] == {"encoded_images": 1, "cached_images": 1}
    assert metric(server, "kvstrata:pinned_pages") == image_pins[0]["pages"]
    assert metric(server, "kvstrata:pinned_bytes") == image_pins[0]["bytes"]
    assert metric(server, "kvstrata:pins_created_total") >= 1
    assert metric(server, "kvstrata:vision_cached_images_total") == 1


@pytest.mark.parametrize(
    ("url", "message"),
    [
        ("data:image/png;base64,aGVsbG8gd29ybGQ=", "not a readable image"),
        (
            "data:image/png;base64," + __import__("base64").b64encode(png_bytes(make_image(2))[:70]).decode(),
            "image",
        ),
        ("https://example.com/cat.png", "fetching remote images is off"),
    ],
)
def test_bad_image_is_a_400_and_leaves_the_cache_unchanged(server: str, url: str, message: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)
    before = httpx.get(server + "/v1/cache").json()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": "Describe it."}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(
            model="vlm", messages=[{"role": "user", "content": content}], max_tokens=2
        )
    body = info.value.body
    assert info.value.status_code == 400 and body["code"] == "invalid_image" and message in body["message"]
    after = httpx.get(server + "/v1/cache").json()
    for key in ("pages_in_tree", "pages_in_use", "pinned_pages", "vision"):
        assert after[key] == before[key], key
    assert [(p["id"], p["tokens"]) for p in after["pins"]] == [(p["id"], p["tokens"]) for p in before["pins"]]
    assert httpx.get(server + "/health").status_code == 200


def test_pin_api(server: str) -> None:
    prompt = "The quick brown fox jumps over the lazy dog. " * 8
    created = httpx.post(
        server + "/v1/cache/pins", json={"prompt": prompt, "ttl_s": 600, "label": "fox"}, timeout=120
    )
    assert created.status_code == 200, created.text
    pin = created.json()
    assert (
        pin["kind"] == "prefix" and pin["label"] == "fox" and pin["tokens"] % PAGE == 0 and pin["tokens"] > 0
    )
    listed = httpx.get(server + "/v1/cache").json()["pins"]
    assert pin["id"] in [p["id"] for p in listed]
    bad = httpx.post(server + "/v1/cache/pins", json={"prompt": "x", "input_ids": [1, 2]})
    assert bad.status_code == 400 and bad.json()["error"]["type"] == "invalid_request_error"
    assert httpx.delete(f"{server}/v1/cache/pins/{pin['id']}").status_code == 200
    gone = httpx.delete(f"{server}/v1/cache/pins/{pin['id']}")
    assert gone.status_code == 404 and gone.json()["error"]["code"] == "pin_not_found"
    assert pin["id"] not in [p["id"] for p in httpx.get(server + "/v1/cache").json()["pins"]]


def test_pin_api_with_an_image_and_over_budget(server: str) -> None:
    image = {"type": "image_url", "image_url": {"url": data_url(make_image(33, (64, 64)))}}
    messages = [{"role": "user", "content": [{"type": "text", "text": "Keep this: "}, image]}]
    created = httpx.post(
        server + "/v1/cache/pins", json={"messages": messages, "label": "photo"}, timeout=120
    )
    assert created.status_code == 200, created.text
    pin = created.json()
    assert pin["kind"] == "prefix" and pin["tokens"] >= IMAGE_TOKENS and pin["ttl_s"] is None
    cache = httpx.get(server + "/v1/cache").json()
    assert cache["pinned_bytes"] <= cache["pin_budget_bytes"]
    refused = metric(server, "kvstrata:pins_refused_total")
    # text pages only: the image's pages (bf16, --vision-kv-dtype auto) cost more per token
    budget_tokens = int(cache["pin_budget_bytes"] // cache["tiers"]["cold"]["bytes_per_token"])
    long_prompt = "cat" + " cat" * (budget_tokens + 32)  # one token per word: more than the whole budget
    over = httpx.post(server + "/v1/cache/pins", json={"prompt": long_prompt}, timeout=300)
    assert over.status_code == 409, over.text
    assert over.json()["error"]["code"] == "pin_budget_exceeded"
    assert "over the pin budget" in over.json()["error"]["message"]
    assert metric(server, "kvstrata:pins_refused_total") == refused + 1
    assert httpx.get(server + "/v1/cache").json()["pinned_bytes"] == cache["pinned_bytes"]
    assert httpx.delete(f"{server}/v1/cache/pins/{pin['id']}").status_code == 200
