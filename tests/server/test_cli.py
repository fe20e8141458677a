"""`kvstrata serve` as a user runs it: a real process, configured through flags and KVSTRATA_* variables."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from kvstrata.quant.scales import ScalesFile

LAYERS, KV_HEADS, HEAD_DIM = 30, 3, 64  # SmolLM2-135M-Instruct's geometry


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _tight_scales(path: Path) -> Path:
    """A scales file whose clip (0.5 per head) is far below real K/V magnitudes: values get clipped."""
    table = {kind: torch.full((LAYERS, KV_HEADS), 0.5) for kind in ("k", "v")}
    ScalesFile(LAYERS, KV_HEADS, HEAD_DIM, False, "max", None, "synthetic", table, dict(table)).save(path)
    return path


def _samples(text: str, name: str) -> list[float]:
    for family in text_string_to_metric_families(text):
        if family.name == name:
            return [s.value for s in family.samples]
    raise KeyError(name)


def _children(pid: int) -> set[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return {int(p) for p in path.read_text().split()} if path.exists() else set()


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_kvstrata_serve_process(tmp_path: Path, engine_process: str) -> None:
    port = _free_port()
    env = dict(
        os.environ,
        KVSTRATA_PORT=str(port),
        KVSTRATA_API_KEY="cli-key",
        KVSTRATA_LOG_LEVEL="warning",
        KVSTRATA_ENGINE_PROCESS=engine_process,
    )
    flags = [
        "--served-model-name",
        "smol",
        "--kv-cache-dtype",
        "int8",
        "--recent-window",
        "16",
        "--kv-scales",
    ]
    cmd = [sys.executable, "-m", "kvstrata", "serve", *flags, str(_tight_scales(tmp_path / "scales.json"))]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "kvstrata serve did not come up"
            time.sleep(0.25)
        auth = {"Authorization": "Bearer cli-key"}
        assert httpx.get(url + "/v1/models").status_code == 401
        models = httpx.get(url + "/v1/models", headers=auth).json()
        assert [m["id"] for m in models["data"]] == ["smol"]
        body = {"model": "smol", "prompt": "Hello " * 40, "max_tokens": 2, "temperature": 0}
        out = httpx.post(url + "/v1/completions", json=body, headers=auth, timeout=60).json()
        assert out["usage"]["completion_tokens"] == 2
        # static scales: the per-layer overflow and absmax gauges carry live values
        text = httpx.get(url + "/metrics").text
        overflow = _samples(text, "kvstrata:quant_overflow_ratio")
        absmax = _samples(text, "kvstrata:kv_absmax_ratio")
        assert len(overflow) == len(absmax) == 2 * LAYERS
        assert max(overflow) > 0.01 and all(0.0 <= r <= 1.0 for r in overflow)
        assert max(absmax) > 2.0  # real magnitudes are several times the 0.5 clip
        children = _children(proc.pid)
        assert len(children) == (engine_process == "on")
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert code == 0
    for child in children:  # the engine process shut down with the server
        assert not Path(f"/proc/{child}").exists() or "zombie" in Path(f"/proc/{child}/status").read_text()


@pytest.mark.parametrize("engine_process", ["off", "on"])
def test_bad_engine_option_is_a_clean_error(engine_process: str) -> None:
    # 24 is not a multiple of the 16-token page: the engine refuses it before loading the model
    cmd = [sys.executable, "-m", "kvstrata", "serve", "--recent-window", "24", "--port", str(_free_port())]
    cmd += ["--engine-process", engine_process]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "cannot start the engine" in proc.stderr and "recent_window" in proc.stderr
