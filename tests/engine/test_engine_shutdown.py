"""`Engine.shutdown` gives back what the engine holds: its cache (pools, ring, sinks), its runner (CUDA
graphs, workspaces) and the weights it loaded itself, without waiting for the garbage collector; a
caller's `LoadedModel` stays the caller's and serves the next engine unchanged."""

from __future__ import annotations

import gc
import weakref

import pytest
import tiny_models
import torch

from kvstrata.engine.engine import Engine
from kvstrata.engine.loader import load_model

ARGS = dict(
    kv_cache_dtype="fp8_e4m3", recent_window=16, page_size=16, max_total_tokens=512, max_running_requests=2
)
PARAMS = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
PROMPT = list(range(5, 45))


@pytest.fixture(scope="module")
def llama_path(tmp_path_factory):
    return tiny_models.save_hf(tiny_models.hf_model("llama3"), tmp_path_factory.mktemp("llama3"))


def held_objects(engine: Engine) -> dict[str, weakref.ref]:
    return {
        "cache": weakref.ref(engine.cache),
        "cold pool": weakref.ref(engine.cache.pool),
        "ring": weakref.ref(engine.cache.ring),
        "runner": weakref.ref(engine.runner),
        "model": weakref.ref(engine.model),
        "weights": weakref.ref(engine.model.net),
    }


def test_shutdown_frees_the_cache_the_runner_and_weights_it_loaded(llama_path):
    engine = Engine(str(llama_path), dtype="float32", device="cpu", drift_sample_rate=1.0, **ARGS)
    engine.generate(input_ids=PROMPT, sampling_params=PARAMS)
    engine.wait_drift_idle()
    held = held_objects(engine)
    gc.disable()  # freed by shutdown itself, not by a collection the test happens to trigger
    try:
        engine.shutdown()
        alive = sorted(name for name, ref in held.items() if ref() is not None)
    finally:
        gc.enable()
    assert alive == []
    assert engine.cache is None and engine.runner is None and engine.model is None
    # what a metrics scrape reads still answers, as it was at shutdown
    assert engine.get_stats().requests_finished_total["success"] == 1
    assert engine.layer_codecs() == engine.get_server_info()["layer_codecs"] == ["fp8_e4m3"] * 2
    assert engine.vision_stats() == {"encoded_images": 0, "cached_images": 0}
    with pytest.raises(RuntimeError, match="shut down"):
        engine.pin(input_ids=PROMPT)
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=PROMPT, sampling_params=PARAMS)
    engine.shutdown()  # a second call is a no-op


def test_a_callers_model_outlives_the_engine_and_serves_the_next(llama_path):
    model = load_model(llama_path, dtype=torch.float32, device="cpu")
    first = Engine(model, **ARGS)
    want = first.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"]
    held = held_objects(first)
    first.shutdown()
    alive = sorted(name for name, ref in held.items() if ref() is not None)
    assert alive == ["model", "weights"]  # the caller's; the engine's own state is gone
    with Engine(model, **ARGS) as second:
        assert second.generate(input_ids=PROMPT, sampling_params=PARAMS)["output_ids"] == want


def test_metrics_of_an_app_that_outlives_its_engine(default_model):
    """An app that keeps serving /metrics after its engine shut down renders counters, not a 500."""
    from kvstrata.server.engine_client import EngineClient
    from kvstrata.server.metrics import ServerMetrics

    engine = Engine(default_model, **ARGS)
    client = EngineClient(engine)
    engine.generate(input_ids=PROMPT, sampling_params=PARAMS)
    before = ServerMetrics(client.snapshot).render().decode()
    engine.shutdown()
    after = ServerMetrics(client.snapshot).render().decode()
    finished = [line for line in before.splitlines() if line.startswith("kvstrata:requests_finished_total")]
    assert any(line.endswith(" 1.0") for line in finished)
    for line in (*finished, 'kvstrata:kv_layer_bits{codec="fp8_e4m3",kind="k",layer="0"} 8.0'):
        assert line in before and line in after, line
    from kvstrata.server.errors import APIError

    with pytest.raises(APIError) as gone:  # a request with images that raced the shutdown
        client.image_token_id()
    assert gone.value.status == 503 and gone.value.code == "engine_unavailable"


def test_a_busy_thread_at_shutdown_keeps_it_all_and_a_retry_frees_it(llama_path, monkeypatch, caplog):
    engine = Engine(str(llama_path), dtype="float32", device="cpu", **ARGS)
    held = held_objects(engine)
    release = type(engine.core).release
    monkeypatch.setattr(type(engine.core), "release", lambda core: False)  # as if a step were still running
    engine.shutdown()
    assert "still in a step" in caplog.text
    assert engine.cache is not None and held["cold pool"]() is not None
    with pytest.raises(RuntimeError, match="shut down"):
        engine.generate(input_ids=PROMPT, sampling_params=PARAMS)
    monkeypatch.setattr(type(engine.core), "release", release)
    engine.shutdown()
    assert engine.cache is None and all(ref() is None for ref in held.values())
