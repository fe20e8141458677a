"""Drift against bytes per token, one point per configuration, the Pareto front marked."""

from __future__ import annotations

from pathlib import Path
from typing import Any


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points no other point beats on both axes (lower bytes, lower drift), by bytes."""
    order = sorted(range(len(points)), key=lambda i: (points[i][0], points[i][1]))
    front: list[int] = []
    best = float("inf")
    for i in order:
        if points[i][1] < best:
            front.append(i)
            best = points[i][1]
    return front


def plot_drift(doc: dict[str, Any], path: str | Path) -> list[int]:
    """Write a PNG of |drift| (with its 95% interval) vs bytes/token; returns the Pareto-front indices."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    results = doc["results"]
    xs = [float(r["bytes_per_token"]) for r in results]
    ys = [float(r["drift_pct"]) for r in results]
    front = pareto_front(list(zip(xs, ys, strict=True)))
    fig, ax = plt.subplots(figsize=(8, 5), dpi=120)
    for r, x, y in zip(results, xs, ys, strict=True):
        lo, hi = r["drift_ci95"]
        ax.errorbar(x, y, yerr=[[max(y - lo, 0.0)], [max(hi - y, 0.0)]], fmt="o", color="tab:blue", ms=4)
        ax.annotate(
            r.get("label", r["kv_cache_dtype"]), (x, y), fontsize=7, xytext=(4, 3), textcoords="offset points"
        )
    fx = [xs[i] for i in front]
    fy = [ys[i] for i in front]
    ax.step(fx, fy, where="post", color="tab:red", lw=1.2, label="Pareto front")
    ax.scatter(fx, fy, s=60, facecolors="none", edgecolors="tab:red")
    ax.axhline(0.0, color="gray", lw=0.6)
    ax.set_xscale("log")
    ax.set_xlabel("cold bytes per token (all layers, K+V, scales included)")
    ax.set_ylabel("perplexity drift vs unquantized (%)")
    ax.set_title(f"{doc['model']}: {doc['tokens']} tokens, context {doc.get('context', '?')}")
    ax.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return front
