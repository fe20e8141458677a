"""Per-request timings -> the figures of SGLang's ``bench_serving``, under its JSON key names.

Only successful requests count towards throughput and latency; failed ones are counted in ``errors``.
Percentiles are numpy's (linear interpolation between closest ranks), as SGLang computes them.
Inter-token latencies are the gaps between consecutive streamed chunks that carry text, pooled
over all requests; TPOT is ``(e2e - ttft) / (output_len - 1)`` per request with more than one token.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class RequestResult:
    """One benchmark request, as the client measured it (seconds since the request was sent)."""

    success: bool = False
    prompt_len: int = 0  # tokens sent (the server's usage.prompt_tokens when it reports one)
    output_len: int = 0  # tokens generated (usage.completion_tokens, else counted; see client.py)
    ttft: float = 0.0  # time to the first chunk with text
    itl: list[float] = field(default_factory=list)  # gaps between the following chunks with text
    latency: float = 0.0  # time to the end of the stream
    error: str = ""
    output_tokens_from: str = "usage"  # "usage", "retokenized" or "chunks"


def _ms(values: list[float], fn: Any) -> float:
    return float(fn(values)) * 1000.0 if values else 0.0


def _p(q: float) -> Any:
    return lambda xs: np.percentile(xs, q)


def compute_metrics(results: list[RequestResult], duration: float) -> dict[str, Any]:
    """The summary of one run (``duration``: wall seconds from the first send to the last end)."""
    if duration <= 0:
        raise ValueError(f"duration must be > 0, got {duration}")
    ok = [r for r in results if r.success]
    total_input = sum(r.prompt_len for r in ok)
    total_output = sum(r.output_len for r in ok)
    ttfts = [r.ttft for r in ok]
    itls = [gap for r in ok for gap in r.itl]
    e2e = [r.latency for r in ok]
    tpots = [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "errors": len(results) - len(ok),
        "total_input_tokens": total_input,
        "total_output_tokens": total_output,
        "request_throughput": len(ok) / duration,
        "input_throughput": total_input / duration,
        "output_throughput": total_output / duration,
        "total_throughput": (total_input + total_output) / duration,
        "concurrency": sum(e2e) / duration,
    }
    for name, values in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2e_latency", e2e)):
        out[f"mean_{name}_ms"] = _ms(values, np.mean)
        out[f"median_{name}_ms"] = _ms(values, np.median)
        out[f"std_{name}_ms"] = _ms(values, np.std)
        out[f"p95_{name}_ms"] = _ms(values, _p(95))
        out[f"p99_{name}_ms"] = _ms(values, _p(99))
    return out
