"""`kvstrata bench` end to end against a real `kvstrata serve` process (the embedded default model)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvstrata.bench.prompts import load_vocabulary, random_prompts
from kvstrata.cli import main

SGLANG_KEYS = {
    "completed", "duration", "request_throughput", "input_throughput", "output_throughput",
    "total_throughput", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms", "mean_itl_ms", "median_itl_ms",
    "p99_itl_ms", "mean_e2e_latency_ms", "median_e2e_latency_ms", "errors",
}  # fmt: skip
MODEL = "SmolLM2-135M-Instruct"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def base_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = _free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    cmd = [
        sys.executable, "-m", "kvstrata.cli", "serve", "--port", str(port), "--kv-cache-dtype", "int8",
        "--recent-window", "32", "--max-total-tokens", "4096", "--max-running-requests", "4",
    ]  # fmt: skip
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            try:
                if httpx.get(url + "/health", timeout=2, trust_env=False).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvstrata serve did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def _bench(url: str, out: Path, *extra: str) -> tuple[int, dict]:
    rc = main(["bench", "--base-url", url, "--output-file", str(out), "--disable-tqdm", *extra])
    lines = out.read_text().splitlines() if out.exists() else []
    return rc, json.loads(lines[-1]) if lines else {}


def test_exact_lengths_with_ignore_eos(base_url: str, tmp_path: Path) -> None:
    out = tmp_path / "bench.jsonl"
    args = ["--num-prompts", "6", "--random-input-len", "40", "--random-output-len", "6"]
    rc, res = _bench(base_url, out, *args, "--random-range-ratio", "1", "--max-concurrency", "3")
    assert rc == 0
    assert res.keys() >= SGLANG_KEYS
    assert res["completed"] == 6 and res["errors"] == 0 and res["model"] == MODEL
    assert res["input_lens"] == [40] * 6 and res["output_lens"] == [6] * 6  # the server's own usage
    assert res["total_input_tokens"] == 240 and res["total_output_tokens"] == 36
    assert res["output_tokens_from"] == "usage"
    assert res["output_throughput"] == pytest.approx(36 / res["duration"])
    assert res["total_throughput"] == pytest.approx(276 / res["duration"])
    assert 0 < res["median_ttft_ms"] <= res["median_e2e_latency_ms"]
    assert res["mean_itl_ms"] > 0
    # a second run appends a second line, as SGLang's --output-file does
    assert (
        _bench(base_url, out, "--num-prompts", "1", "--random-input-len", "8", "--random-output-len", "2")[0]
        == 0
    )
    assert len(out.read_text().splitlines()) == 2


def test_ranged_lengths_at_a_request_rate_match_the_seeded_prompts(base_url: str, tmp_path: Path) -> None:
    args = ["--num-prompts", "5", "--random-input-len", "30", "--random-output-len", "5"]
    rc, res = _bench(base_url, tmp_path / "b.jsonl", *args, "--random-range-ratio", "0.5",
                     "--request-rate", "20", "--seed", "7")  # fmt: skip
    assert rc == 0 and res["completed"] == 5 and res["errors"] == 0 and res["request_rate"] == 20.0
    want = random_prompts(load_vocabulary(None, MODEL), 5, 30, 5, 0.5, seed=7)
    assert res["input_lens"] == [len(p.ids) for p in want]
    assert res["output_lens"] == [p.output_len for p in want]


def test_worker_processes_share_the_requests_in_prompt_order(base_url: str, tmp_path: Path) -> None:
    """--num-workers 3: 7 seeded prompts of ranged lengths over 3 client processes (round robin, the cap
    of 4 split 2/1/1), Poisson arrivals from a common start; the JSON is in prompt order, every request
    counted once, and the duration covers them all."""
    args = ["--num-prompts", "7", "--random-input-len", "24", "--random-output-len", "5", "--seed", "5",
            "--random-range-ratio", "0.5", "--request-rate", "30", "--max-concurrency", "4"]  # fmt: skip
    rc, res = _bench(base_url, tmp_path / "w.jsonl", *args, "--num-workers", "3")
    assert rc == 0 and res["completed"] == 7 and res["errors"] == 0
    want = random_prompts(load_vocabulary(None, MODEL), 7, 24, 5, 0.5, seed=5)
    assert res["input_lens"] == [len(p.ids) for p in want]
    assert res["output_lens"] == [p.output_len for p in want]
    assert res["total_output_tokens"] == sum(p.output_len for p in want)
    # the mean number in flight (latencies over the duration) stays within the cap of 4
    assert 1e3 * res["duration"] >= res["median_e2e_latency_ms"] and 0 < res["concurrency"] <= 4.0
    assert 0 < res["median_ttft_ms"] <= res["median_e2e_latency_ms"]


def test_text_prompts_count_the_servers_tokens(base_url: str, tmp_path: Path) -> None:
    args = ["--num-prompts", "3", "--random-input-len", "20", "--random-output-len", "4"]
    rc, res = _bench(base_url, tmp_path / "t.jsonl", *args, "--random-range-ratio", "1",
                     "--dataset-name", "random")  # fmt: skip
    assert rc == 0 and res["completed"] == 3 and res["output_lens"] == [4] * 3
    assert all(n > 0 for n in res["input_lens"])  # re-tokenized text: close to, not always, 20


def test_a_refused_warm_up_is_one_clear_error(base_url: str, tmp_path: Path, capsys) -> None:
    rc, res = _bench(base_url, tmp_path / "e.jsonl", "--model", "no-such-model", "--tokenizer",
                     str(_smol_dir()), "--num-prompts", "2")  # fmt: skip
    assert rc == 1 and res == {}
    err = capsys.readouterr().err
    assert "warm-up request failed" in err and "HTTP 404" in err and "no-such-model" in err


def _smol_dir() -> Path:
    from kvstrata import resources

    return resources.default_model_path()
