"""What `kvstrata serve` does once before it listens: freeze the objects startup built, so a full
garbage collection during serving walks only what serving allocated."""

from __future__ import annotations

import argparse
import gc
from typing import Any

from kvstrata.server import cli
from kvstrata.server.app import freeze_startup_objects


def test_freeze_moves_live_objects_out_of_the_collectors_reach() -> None:
    gc.unfreeze()
    kept = [[i] for i in range(1000)]  # tracked containers alive now
    try:
        freeze_startup_objects()
        assert gc.get_freeze_count() >= len(kept)
        assert all(gc.is_tracked(x) for x in kept)  # still tracked, just frozen
    finally:
        gc.unfreeze()


def test_serve_freezes_before_it_listens(monkeypatch) -> None:
    calls: list[str] = []

    class FakeEngine:
        def __init__(self, **kwargs: Any) -> None:
            calls.append(f"engine warmup={kwargs['warmup']}")

        def get_server_info(self) -> dict[str, Any]:
            return {"kv_cache_dtype": "auto", "recent_window": 0, "max_total_tokens": 1}

        def shutdown(self) -> None:
            calls.append("shutdown")

    class FakeApp:
        class state:
            class kvstrata:
                class client:
                    model_name = "m"

    import uvicorn

    import kvstrata

    monkeypatch.setattr(kvstrata, "Engine", FakeEngine)
    monkeypatch.setattr("kvstrata.server.app.create_app", lambda engine, config: FakeApp())
    monkeypatch.setattr("kvstrata.server.app.freeze_startup_objects", lambda: calls.append("freeze"))
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: calls.append("listen"))
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    before = gc.get_threshold()
    try:
        assert cli.run(parser.parse_args([])) == 0
        assert gc.get_threshold() == (50000, 20, 100)
    finally:
        gc.set_threshold(*before)  # serve sets its own thresholds for the process
    assert calls == ["engine warmup=cuda", "freeze", "listen", "shutdown"]
