"""`kvstrata bench`: the command line, the result table and the JSON line."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

HELP = (
    "Serving benchmark for an OpenAI-compatible endpoint (kvstrata, SGLang, vLLM): concurrent streaming "
    "requests of random token ids; prints SGLang bench_serving's figures and appends them as JSON."
)
DATASETS = ("random-ids", "random")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add = parser.add_argument
    add("--base-url", default="http://127.0.0.1:30000", help="server root, without /v1")
    add("--model", default=None, help="model id to request (default: the first of /v1/models)")
    add(
        "--tokenizer",
        default=None,
        help="model/tokenizer directory or GGUF file whose vocabulary the prompts use (default: the "
        "served model's path, or kvstrata's embedded model); a directory with only config.json gives "
        "random ids below its vocab_size",
    )
    add("--dataset-name", choices=DATASETS, default="random-ids", help="random-ids: token-id prompts "
        "(exact lengths); random: the same ids decoded to text")  # fmt: skip
    add("--num-prompts", type=_positive_int, default=1000)
    add("--random-input-len", type=_positive_int, default=1024, help="prompt tokens (upper bound)")
    add("--random-output-len", type=_positive_int, default=1024, help="tokens to generate (upper bound)")
    add(
        "--random-range-ratio",
        type=float,
        default=0.0,
        help="lengths are uniform in [len * ratio, len]; 1 makes them exact",
    )
    add("--max-concurrency", type=_positive_int, default=None, help="cap on requests in flight")
    add("--request-rate", type=float, default=math.inf, help="requests/s, Poisson arrivals (default: inf)")
    add("--seed", type=int, default=1)
    add("--output-file", default=None, help="append one JSON line with the results to this file")
    add("--disable-ignore-eos", action="store_true", help="let requests end at EOS (lengths then vary)")
    add("--disable-tqdm", action="store_true", help="no progress bar (SGLang's flag name)")
    add("--warmup-requests", type=int, default=1, help="requests sent (and not counted) before the run")
    add(
        "--num-workers",
        type=_positive_int,
        default=1,
        help="client processes sharing the requests and the concurrency cap (one event loop falls "
        "behind hundreds of streams and inflates the ITL it measures; e.g. 4 at 256 streams)",
    )
    add("--api-key", default=os.environ.get("OPENAI_API_KEY"), help="Bearer key [env OPENAI_API_KEY]")


def served_model(base_url: str, api_key: str | None) -> str:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    resp = httpx.get(base_url.rstrip("/") + "/v1/models", headers=headers, timeout=30, trust_env=False)
    resp.raise_for_status()
    models = resp.json().get("data") or []
    if not models:
        raise ValueError(f"{base_url}/v1/models lists no model")
    return str(models[0]["id"])


ROWS: tuple[tuple[str, str, str], ...] = (
    ("Successful requests", "completed", "{:d}"),
    ("Failed requests", "errors", "{:d}"),
    ("Benchmark duration (s)", "duration", "{:.2f}"),
    ("Total input tokens", "total_input_tokens", "{:d}"),
    ("Total generated tokens", "total_output_tokens", "{:d}"),
    ("Request throughput (req/s)", "request_throughput", "{:.2f}"),
    ("Input token throughput (tok/s)", "input_throughput", "{:.2f}"),
    ("Output token throughput (tok/s)", "output_throughput", "{:.2f}"),
    ("Total token throughput (tok/s)", "total_throughput", "{:.2f}"),
    ("Concurrency", "concurrency", "{:.2f}"),
    ("Mean E2E latency (ms)", "mean_e2e_latency_ms", "{:.2f}"),
    ("Median E2E latency (ms)", "median_e2e_latency_ms", "{:.2f}"),
    ("Mean TTFT (ms)", "mean_ttft_ms", "{:.2f}"),
    ("Median TTFT (ms)", "median_ttft_ms", "{:.2f}"),
    ("P99 TTFT (ms)", "p99_ttft_ms", "{:.2f}"),
    ("Mean TPOT (ms)", "mean_tpot_ms", "{:.2f}"),
    ("Median TPOT (ms)", "median_tpot_ms", "{:.2f}"),
    ("Mean ITL (ms)", "mean_itl_ms", "{:.2f}"),
    ("Median ITL (ms)", "median_itl_ms", "{:.2f}"),
    ("P99 ITL (ms)", "p99_itl_ms", "{:.2f}"),
)


def print_table(result: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="Serving Benchmark Result")
    table.add_column("metric")
    table.add_column("value", justify="right")
    table.add_row("Model", str(result["model"]))
    table.add_row("Max concurrency", str(result["max_concurrency"]))
    table.add_row("Request rate (req/s)", str(result["request_rate"]))
    for label, key, fmt in ROWS:
        table.add_row(label, fmt.format(result[key]))
    Console().print(table)


def run(args: argparse.Namespace) -> int:
    from kvstrata.bench.client import Endpoint
    from kvstrata.bench.metrics import compute_metrics
    from kvstrata.bench.prompts import load_vocabulary, random_prompts
    from kvstrata.bench.runner import Load, run_load

    try:
        model = args.model or served_model(args.base_url, args.api_key)
        vocab = load_vocabulary(args.tokenizer, model)
        prompts = random_prompts(
            vocab,
            args.num_prompts,
            args.random_input_len,
            args.random_output_len,
            args.random_range_ratio,
            args.seed,
        )
        if args.dataset_name == "random" and vocab.tokenizer is None:
            raise ValueError("--dataset-name random needs a tokenizer to decode the prompts")
        endpoint = Endpoint(
            args.base_url, model, args.api_key, not args.disable_ignore_eos, args.dataset_name == "random"
        )
        load = Load(
            args.request_rate,
            args.max_concurrency,
            args.seed,
            args.warmup_requests,
            not args.disable_tqdm,
            args.num_workers,
        )
        results, duration = asyncio.run(run_load(endpoint, vocab, prompts, load))
    except Exception as exc:  # a bad flag, an unreachable server, a failed warm-up: one clear line
        print(f"kvstrata bench: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1
    metrics = compute_metrics(results, duration)
    sources = sorted({r.output_tokens_from for r in results if r.success})
    result: dict[str, Any] = {
        "backend": "openai-completions",
        "base_url": args.base_url,
        "model": model,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "random_input_len": args.random_input_len,
        "random_output_len": args.random_output_len,
        "random_range_ratio": args.random_range_ratio,
        "request_rate": "inf" if math.isinf(args.request_rate) else args.request_rate,
        "max_concurrency": args.max_concurrency,
        "ignore_eos": endpoint.ignore_eos,
        "seed": args.seed,
        "output_tokens_from": ",".join(sources),
        **metrics,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": [r.output_len for r in results],
        "error_messages": sorted({r.error for r in results if not r.success}),
    }
    print_table(result)
    if args.output_file:
        path = Path(args.output_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as f:
            f.write(json.dumps(result) + "\n")
    return 0 if metrics["errors"] == 0 else 1
