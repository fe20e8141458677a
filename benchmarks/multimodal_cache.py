"""Same image, different questions: the first request runs the vision tower and prefills the image
span; the next ones match its pinned pages, skip the tower and prefill only their question.

Uses the assembled LLaVA-style model (embedded SmolLM2-135M + random SigLIP tower, 64 image tokens).
After a warm-up request with another image, prints the time to the first token of the uncached
request, the mean of the cached ones, their ratio, cached tokens, and vision tower runs.
``python benchmarks/multimodal_cache.py --questions 8``
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
from PIL import Image

from kvstrata import Engine
from kvstrata.multimodal.assemble import assemble


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--questions", type=int, default=8)
    parser.add_argument("--kv-cache-dtype", default="fp8_e4m3")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        engine = Engine(str(assemble(Path(tmp) / "vlm")), kv_cache_dtype=args.kv_cache_dtype)
    rng = np.random.default_rng(0)
    image = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    system = "You are a careful assistant that describes product photos for a catalogue. " * 4
    warmup = Image.fromarray(rng.integers(0, 256, (480, 640, 3), dtype=np.uint8))
    engine.generate(prompt="<image>Warm-up.", image_data=[warmup], sampling_params={"max_new_tokens": 1})
    times, cached = [], []
    for i in range(args.questions + 1):
        messages = [
            {"role": "system", "content": system},
            {"role": "user", "content": f"<image>Question {i}: what is shown, and in which colours?"},
        ]
        prompt = engine.apply_chat_template(messages)
        start = time.perf_counter()
        out = engine.generate(prompt=prompt, image_data=[image], sampling_params={"max_new_tokens": 1})
        times.append(time.perf_counter() - start)
        cached.append(out["meta_info"]["cached_tokens"])
        prompt_tokens = out["meta_info"]["prompt_tokens"]
    warm = sum(times[1:]) / args.questions
    stats = engine.vision_stats()
    print(f"prompt tokens {prompt_tokens} (64 image tokens), kv_cache_dtype {args.kv_cache_dtype}")
    print(f"uncached request: {times[0] * 1000:.0f} ms to the first token, {cached[0]} cached tokens")
    n, low = args.questions, min(cached[1:])
    print(f"same image, {n} new questions: {warm * 1000:.0f} ms mean, {low} cached tokens")
    print(f"ratio uncached / cached: {times[0] / warm:.2f}x")
    runs, skipped = stats["encoded_images"], stats["cached_images"]
    print(f"vision tower runs: {runs} (one is the warm-up), skipped: {skipped}")
    print(f"pins: {[(p['kind'], p['tokens']) for p in engine.list_pins()]}")
    engine.shutdown()


if __name__ == "__main__":
    main()
