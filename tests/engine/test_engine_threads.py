"""What the engine shares between threads: the tokenizer, and the drift monitor's fallback window."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import threading
import time
from typing import Any

from kvstrata.engine.engine import Engine


class BorrowChecked:
    """A tokenizer that fails as a Rust ``RefCell`` does when two threads are inside it at once."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.inside = 0
        self.guard = threading.Lock()
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        value = getattr(self.inner, name)
        if not callable(value):
            return value

        def call(*args: Any, **kwargs: Any) -> Any:
            with self.guard:
                self.inside += 1
                busy = self.inside > 1
                self.calls += 1
            try:
                if busy:
                    raise RuntimeError("Already borrowed")
                time.sleep(0.002)  # hold the borrow long enough for other threads to collide
                return value(*args, **kwargs)
            finally:
                with self.guard:
                    self.inside -= 1

        return call

    def __len__(self) -> int:
        return len(self.inner)


def test_one_tokenizer_is_safe_across_threads(default_model):
    checked = BorrowChecked(default_model.tokenizer)
    model = dataclasses.replace(default_model, tokenizer=checked)
    eng = Engine(model=model, kv_cache_dtype="auto", max_total_tokens=2048, max_running_requests=8)
    try:
        words = [
            "the",
            "quick",
            "brown",
            "fox",
            "jumps",
            "over",
            "a",
            "lazy",
            "dog",
            "while",
            "seven",
            "wizards",
        ]

        def one(i: int) -> str:
            text = " ".join(words[i % 5 :] + words[: i % 5])
            eng.tokenizer.encode(text)  # as the server's worker threads do
            out = eng.generate(prompt=text, sampling_params={"max_new_tokens": 6, "ignore_eos": True})
            assert out["meta_info"]["finish_reason"]["type"] == "length", out["meta_info"]
            return out["text"]

        with concurrent.futures.ThreadPoolExecutor(6) as pool:
            texts = list(pool.map(one, range(12), timeout=300))
        assert len(texts) == 12 and checked.calls > 12 * 6  # encodes, and a decode per token
        assert eng.get_stats().requests_finished_total["error"] == 0
    finally:
        eng.shutdown()


def test_the_engine_applies_the_monitors_window_even_if_a_report_is_lost(default_model):
    """The drift worker changes the level on its thread; the engine must end up using the window
    of the monitor's current level however the two threads interleave, including when the
    worker's report of a change is overwritten before the engine thread reads it."""
    eng = Engine(
        model=default_model,
        kv_cache_dtype="int8",
        recent_window=16,
        max_total_tokens=1024,
        drift_sample_rate=1e-9,  # the monitor runs; nothing gets sampled
        drift_max_level=2,
    )
    try:
        drift = eng.drift
        assert drift is not None and eng.cache.recent_window == 16
        with drift.lock:
            drift.policy.level = 2  # a change whose report never reached the engine thread
        eng.core._wake.set()
        deadline = time.monotonic() + 30
        while (eng.cache.recent_window, eng.cache.raised) != (drift.window(), drift.raised()) and (
            time.monotonic() < deadline
        ):
            time.sleep(0.05)
        # level 1 is the precision raise (int8 -> int8_asym keys, bf16 values), level 2 its first window step
        assert drift.window() == 32 and drift.raised()
        assert eng.cache.recent_window == 32 and eng.cache.raised
        out = eng.generate(input_ids=list(range(100, 180)), sampling_params={"max_new_tokens": 4})
        assert out["meta_info"]["completion_tokens"] == 4
    finally:
        eng.shutdown()
